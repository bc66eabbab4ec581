"""One escaping step per sink, for every string that came from a run or from code.

A run's name, a checkpoint's file name, a config value, a probe's reason: any of them can hold a terminal
escape, a bidirectional override, an invisible character, a newline followed by something that looks like
sleuth's own output, or markdown and HTML. Each sink has one function here, and every renderer passes every
such field through it (never a whole rendered document, which would also escape sleuth's own markup):

- terminal (`terminal`): one line. Every unsafe code point (below) is shown as an escape, `\\xNN`, `\\uNNNN`
  or `\\UNNNNNNNN`, so ESC/CSI/OSC sequences, C0/C1 controls, bidi overrides and invisible format characters
  are visible and inert, and a newline cannot start a line of its own; then secrets are masked
  (sleuth.redact). The text is otherwise unchanged (a backslash stays a backslash).
- markdown (`markdown`, `markdown_code`): the terminal's escaping with every kind of line break collapsed to
  one space (a table cell, a list item stay one line), then markdown and HTML escaped, so no value can open a
  heading, a quote, a list, a link, an image, a table cell, emphasis or an HTML tag: `&`, `<`, `>` become
  entities, the inline metacharacters (`#` included) get a backslash, and a leading `-`, `+`, `=` or `1.`
  is escaped where a value starts a list item. `markdown_code` writes a code span that no backtick in the value closes.
- YAML (`terminal_data`): fix.yaml's strings are the terminal's escaping of the values, so the file always
  parses back with `yaml.safe_load` and shows what was escaped.
- JSON (`dumps`, `json_text`): strict JSON (RFC 8259): a number that is not finite (NaN, ±Infinity) is written
  as `null`, never as the `NaN`/`Infinity` that strict parsers refuse, and the unsafe code points are written
  as `\\uXXXX` escapes: the data is unchanged, the file holds no raw control or invisible character.

Unsafe code points: the Unicode categories Cc (controls: C0, DEL, C1, so ESC and every sequence it starts),
Cf (format: bidi marks and overrides U+061C/U+200E/U+202A-202E/U+2066-2069, zero-width U+200B-200D, U+FEFF,
soft hyphen U+00AD, tags), Zl and Zp (U+2028, U+2029), Cs (lone surrogates: a non-UTF-8 file name's bytes,
shown as `\\xNN` as sleuth.artifacts.printable does), Co (private use) and Cn (unassigned), plus the letters
that render as nothing (Hangul fillers, U+034F, U+17B4/5). Everything else (letters, marks, digits,
punctuation, symbols, spaces of any width) is printed as it is.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

# The code-point level lives in sleuth.codepoints (sleuth.redact's console writer uses it too); importers of
# sleuth.escape keep finding it here.
from sleuth.codepoints import UNSAFE_CATEGORIES, escape_unsafe, is_unsafe  # noqa: F401

# Every line break Python's str.splitlines() knows, CR included.
LINE_BREAKS = frozenset("\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
_BREAK_RUN = re.compile("[" + "".join(sorted(LINE_BREAKS)) + "]+")

# Markdown that can act anywhere inside a line (CommonMark + GitHub: emphasis, code, links and images,
# tables, strikethrough, math, backslash escapes); escaped with a backslash.
# An underscore inside a word cannot open or close emphasis (CommonMark's flanking rules), so an identifier
# like loss_decay_gamma is left as it reads.
_MD_INLINE = re.compile(r"([\\`*\[\]|~$#]|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z]))")
# ... and what only acts at the start of a block ("#" is escaped everywhere): a value that begins a list item
# ("- {note}") could open a nested list, a setext rule or an ordered list.
_MD_LEADING = re.compile(r"^(\s*)([+=\-]|\d+[.)])")


def _limited(text: str, limit: int | None) -> str:
    return text if limit is None or len(text) <= limit else text[: max(limit - 1, 0)] + "…"


def terminal(text: object, *, limit: int | None = None) -> str:
    """One line for stdout/stderr (and fix.yaml): secrets masked, every unsafe code point escaped, cut to
    `limit` characters."""
    from sleuth.redact import redact

    return _limited(escape_unsafe(redact(str(text))), limit)


def terminal_data(value: Any) -> Any:
    """Every string inside a JSON-like value (keys too) as `terminal` writes it."""
    if isinstance(value, str):
        return terminal(value)
    if isinstance(value, dict):
        return {terminal_data(k): terminal_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [terminal_data(v) for v in value]
    return value


def _one_line(text: object) -> str:
    from sleuth.redact import redact

    return escape_unsafe(_BREAK_RUN.sub(" ", redact(str(text))))


def markdown(text: object, *, limit: int | None = None) -> str:
    """One field of report.md as inline text: one line, unsafe code points escaped, markdown and HTML inert."""
    line = _limited(_one_line(text), limit)
    line = line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    line = _MD_INLINE.sub(r"\\\1", line)
    return _MD_LEADING.sub(lambda m: m[1] + m[2][:-1] + "\\" + m[2][-1], line)  # "-" -> "\\-", "1." -> "1\\."


def markdown_code(text: object, *, in_table: bool = False, limit: int | None = None) -> str:
    """One field of report.md as a code span: shown literally (no markdown, HTML or entity acts inside one);
    the fence is longer than any run of backticks in the value. In a table cell `|` still splits the cell
    (GitHub reads the row before the span), so there it is escaped."""
    line = _limited(_one_line(text), limit)
    longest = max((len(run) for run in re.findall("`+", line)), default=0)
    fence = "`" * (longest + 1)
    if line.startswith("`") or line.endswith("`") or not line.strip():
        line = f" {line} "
    if in_table:
        line = line.replace("|", "\\|")
    return f"{fence}{line}{fence}"


def finite(value: Any) -> Any:
    """A JSON-like value with every non-finite float (NaN, ±Infinity) as None: strict JSON's `null`."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def json_text(serialized: str) -> str:
    """Serialized JSON with each unsafe code point as a `\\uXXXX` escape (a surrogate pair beyond U+FFFF).

    JSON's structure is ASCII, so such a code point can only sit inside a string, where the escape means the
    same character: the data is unchanged."""
    if serialized.isprintable() or not any(is_unsafe(ch) and ch not in "\n" for ch in serialized):
        return serialized

    def spell(ch: str) -> str:
        if ch == "\n" or not is_unsafe(ch):  # the newlines of indented JSON are layout, outside any string
            return ch
        code = ord(ch)
        if code < 0x10000:
            return f"\\u{code:04x}"
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"

    return "".join(spell(ch) for ch in serialized)


def dumps(value: Any, **options: Any) -> str:
    """json.dumps for a file sleuth writes: strict (non-finite numbers as null), unsafe code points escaped."""
    return json_text(json.dumps(finite(value), allow_nan=False, ensure_ascii=False, **options))


__all__ = ["LINE_BREAKS", "UNSAFE_CATEGORIES", "dumps", "escape_unsafe", "finite", "is_unsafe", "json_text",
           "markdown", "markdown_code", "terminal", "terminal_data"]
