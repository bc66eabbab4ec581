"""Which code points may not reach a terminal or a document raw, and how each is written instead.

The character level under sleuth.escape (every sink's escaping) and sleuth.redact's console writer (the
terminal's last gate); its own module so that the two use one definition without importing each other.
See sleuth.escape's docstring for the categories and why.
"""

from __future__ import annotations

import unicodedata

UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
# Assigned letters and marks that render as nothing (Unicode's Default_Ignorable_Code_Point, less the
# variation selectors an emoji needs): as good as invisible format characters for hiding text.
_INVISIBLE_GRAPHIC = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u3164\uffa0")


def is_unsafe(ch: str) -> bool:
    """Whether this code point must not reach a terminal or a document raw (see the module docstring)."""
    if ch.isprintable():  # the fast path: printable is every category but C*, Z* (bar the plain space)
        return ch in _INVISIBLE_GRAPHIC
    return unicodedata.category(ch) in UNSAFE_CATEGORIES


def _escape(ch: str) -> str:
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte of a non-UTF-8 file name (surrogateescape): the byte itself
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape_unsafe(text: str) -> str:
    """`text` with every unsafe code point written as its escape; nothing else changes (no redaction)."""
    if text.isprintable() and not any(ch in _INVISIBLE_GRAPHIC for ch in text):
        return text
    return "".join(_escape(ch) if is_unsafe(ch) else ch for ch in text)
