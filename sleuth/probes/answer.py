"""The worker's answer, as sleuth accepts it: bounded, schema-checked and made safe to print.

The answer file is written by a process that ran code sleuth does not control, so it is read like any
hostile input: a regular file (no link, FIFO or device), at most `Limits.answer_bytes`, JSON of bounded
depth and finite numbers, then validated against `ProbeAnswer` (pydantic): the verdicts, and everything the
worker returns besides them (the subject's describe(), the located pieces of a probe without an adapter
and how each was bound, `sleuth probe check`'s results, the methods an entry does not provide). Every
string in it is made safe first (`safe_text`): control and invisible format characters removed (terminal
escapes, bidirectional marks and overrides, zero-width characters, soft hyphens, byte-order marks), line
breaks of every kind folded to spaces (only the traceback keeps its lines), and any secret sleuth can
recognise masked (sleuth.redact). Numbers that JSON cannot hold (NaN, Infinity) become the strings "nan",
"inf", "-inf" where a value is free-form (a measurement) and are refused where a number is due (seconds).
Anything that fails is one line, `AnswerError`, which turns every probe `unknown` with that reason.

Safe text is not escaped text: a renderer still escapes what its format gives meaning to (markdown,
HTML: sleuth/report/markdown.py); this module makes sure no string can hold a line break, an escape or
an invisible character to begin with.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from sleuth.escape import is_unsafe
from sleuth.probes.pieces import HELPER_KINDS, PIECE_KINDS
from sleuth.probes.protocol import PROTOCOL_METHODS
from sleuth.probes.verdict import ANSWER_INVARIANTS, MISMATCH_ONLY_INVARIANTS, PROBE_STATUSES, Verdict
from sleuth.redact import redact

MAX_DEPTH = 32
MAX_VERDICTS = 500
MAX_PIECES = 500
MAX_LINE_CHARS = 2000  # one string of the answer (a reason, a measurement); longer ones are cut
MAX_TEXT_CHARS = 20_000  # the traceback
# Every line break Python's str.splitlines() knows but the carriage return (dropped), and the tab: in a
# single-line field each becomes a space.
_BREAKS = frozenset("\n\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029\t")
CHECK_NAMES = (*PROTOCOL_METHODS, "embeddings/lm_head")


class AnswerError(ValueError):
    """The answer cannot be used; the message is one line."""


def safe_text(text: str, *, multiline: bool = False, limit: int | None = None) -> str:
    """`text` that may be printed or written: no control or invisible format character (sleuth.escape's unsafe
    code points: Unicode Cc, Cf, Cs, Co, Cn, the letters that render as nothing: escapes, bidirectional marks,
    zero-width characters), no line break unless `multiline` (then
    each break is one "\\n"), other spaces as " ", no recognisable secret; cut to `limit` characters."""
    if not text.isprintable() or any(is_unsafe(ch) for ch in text):
        kept = []
        for ch in text:
            if ch == "\r":  # a terminal control more than a break (it rewrites the line); "\r\n" is one break
                continue
            elif ch in _BREAKS:
                kept.append(("\t" if ch == "\t" else "\n") if multiline else " ")
            elif is_unsafe(ch):
                continue  # sleuth.escape's unsafe code points (Cc, Cf, Cs, Co, Cn, invisible letters): dropped
            elif ch.isprintable():
                kept.append(ch)
            else:  # a space of another width (Zs)
                kept.append(" ")
        text = "".join(kept)
    text = redact(text)
    if limit is not None and len(text) > limit:
        text = text[: limit - 1] + "…"
    return text


def _identifier(value: str) -> str:
    if not value.isidentifier():
        raise ValueError(f"{value[:60]!r} is not a Python identifier")
    return value


Identifier = Annotated[str, Field(max_length=200), AfterValidator(_identifier)]
Invariant = Literal[ANSWER_INVARIANTS]  # type: ignore[valid-type]
Literal_ = str | int | float | bool | None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class Binding(_Strict):
    """How one parameter of a located piece was bound (binding.Call.binding): what `sleuth probe init`
    writes the entry's call from, so every field that becomes source text is checked here."""

    role: Identifier | None = None
    variant: str | None = Field(default=None, max_length=200)
    passed: Literal_ | list[Literal_] = None  # a literal the run passes (repr'd into the entry)
    default: bool | None = None
    config: Identifier | None = None  # a config class of the code, by name
    namespace: list[str] | None = None  # options a stand-in config was asked for

    @field_validator("namespace")
    @classmethod
    def _attribute_names_only(cls, names: list[str] | None) -> list[str] | None:
        # the code under diagnosis chose these names (getattr on a stand-in): only real attribute names stay
        return None if names is None else [n for n in names if n.isidentifier()][:200]


class PieceReport(_Strict):
    """One located piece, as the generic subject reports it (sleuth/probes/adapters/generic.py)."""

    kind: Literal[(*PIECE_KINDS, *HELPER_KINDS)]  # type: ignore[valid-type]
    where: str
    qualname: str
    found_by: str = ""
    used_by: str = ""
    outcome: Literal["", "measured", "not bound", "failed", "not needed"] = ""
    called: str = ""
    detail: str = ""
    decided: list[Invariant] = Field(default_factory=list)
    binding: dict[Identifier, Binding] = Field(default_factory=dict)


class SubjectInfo(BaseModel):
    """The subject's describe() (fields of protocol.DESCRIBE_FIELDS, and whatever else it returns), plus, for
    probes without an adapter, the located pieces."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    pieces: list[PieceReport] = Field(default_factory=list, max_length=MAX_PIECES)
    missing: dict[str, str] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)


class ProbeAnswer(_Strict):
    """What `sleuth.probes.worker` writes to its OUT.json."""

    subject: SubjectInfo | None = None
    verdicts: list[Verdict] = Field(default_factory=list, max_length=MAX_VERDICTS)
    error: str | None = None  # why no experiment ran
    python: str | None = None
    torch: str | None = None
    seconds: dict[str, float] = Field(default_factory=dict)
    traceback: str | None = None
    not_provided: dict[Literal[PROTOCOL_METHODS], str] = Field(default_factory=dict)  # type: ignore[valid-type]
    checks: dict[Literal[CHECK_NAMES], str] | None = None  # type: ignore[valid-type]  # `sleuth probe check`

    @field_validator("verdicts")
    @classmethod
    def _probed_invariants_only(cls, verdicts: list[Verdict]) -> list[Verdict]:
        # A verdict on an invariant no experiment decides (a config-level one) can only be forged.
        for number, verdict in enumerate(verdicts):
            if verdict.status not in PROBE_STATUSES:
                raise ValueError(f"verdict {number}: status {verdict.status!r} is not one of {', '.join(PROBE_STATUSES)}")
            if verdict.invariant not in ANSWER_INVARIANTS:
                raise ValueError(f"verdict {number}: {verdict.invariant!r} is not an invariant the probes decide")
            if verdict.invariant in MISMATCH_ONLY_INVARIANTS and verdict.status == "match":
                raise ValueError(f"verdict {number}: {verdict.invariant!r} is one the probes can show broken, never "
                                 "clear (a match on it can only be forged)")
            if isinstance(verdict.seconds, float) and not math.isfinite(verdict.seconds):
                raise ValueError(f"verdict {number}: seconds is not a finite number")
        return verdicts

    def subject_info(self) -> dict[str, Any] | None:
        """The subject as a plain dict: the fields it sent; every located piece in full, each binding with only
        the keys it sent (`"passed" in binding` is what tells a literal None from no literal)."""
        if self.subject is None:
            return None
        info = self.subject.model_dump(exclude_unset=True, exclude={"pieces"})
        if self.subject.pieces:
            info["pieces"] = [{**piece.model_dump(exclude={"binding"}),
                               "binding": {name: how.model_dump(exclude_unset=True) for name, how in piece.binding.items()}}
                              for piece in self.subject.pieces]
        return info


def read_answer(path: Path, max_bytes: int) -> ProbeAnswer | None:
    """The validated, cleaned answer; None when there is no answer file; AnswerError when it is unusable."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise AnswerError(f"the probe's answer cannot be opened ({exc.strerror or exc}: a link or a special file?)") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise AnswerError("the probe's answer is not a regular file")
        if info.st_size > max_bytes:
            raise AnswerError(f"the probe's answer is {info.st_size} bytes, over the {max_bytes // 2**20} MiB limit")
        data = os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)
    return parse_answer(data, max_bytes)


def parse_answer(data: bytes, max_bytes: int) -> ProbeAnswer:
    if len(data) > max_bytes:
        raise AnswerError(f"the probe's answer is over the {max_bytes // 2**20} MiB limit")
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else f"not UTF-8 JSON: {str(exc)[:120]}"
        raise AnswerError(safe_text(f"the probe's answer is {reason}")) from None
    if not isinstance(value, dict):
        raise AnswerError(f"the probe's answer is a JSON {type(value).__name__}, not an object")
    if _depth(value) > MAX_DEPTH:
        raise AnswerError(f"the probe's answer is nested deeper than {MAX_DEPTH} levels")
    cleaned = {key: _cleaned(item, multiline=key == "traceback") for key, item in value.items()}
    try:
        return ProbeAnswer.model_validate(cleaned)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "answer"
        raise AnswerError(safe_text(f"the probe's answer does not follow the schema: {where}: {first.get('msg')}",
                                    limit=300)) from None


def _cleaned(value: Any, *, multiline: bool = False) -> Any:
    if isinstance(value, str):
        return safe_text(value, multiline=multiline, limit=MAX_TEXT_CHARS if multiline else MAX_LINE_CHARS)
    if isinstance(value, float) and not math.isfinite(value):
        # free-form: its spelling; where the schema wants a number, a string fails validation (seconds)
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {safe_text(str(k), limit=MAX_LINE_CHARS): _cleaned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_cleaned(v) for v in value]
    return value


def _depth(value: Any) -> int:
    """Nesting depth, iteratively (a deep answer must not exhaust sleuth's own stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


__all__ = ["AnswerError", "Binding", "PieceReport", "ProbeAnswer", "SubjectInfo", "parse_answer", "read_answer",
           "safe_text"]
