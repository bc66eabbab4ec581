"""The worker's answer, as sleuth accepts it: bounded, schema-checked and made safe to print.

The answer file is written by a process that ran code sleuth does not control, so it is read like any
hostile input: a regular file (no link, FIFO or device), at most `Limits.answer_bytes`, JSON of bounded
depth, then validated against `ProbeAnswer` (pydantic). Every string in it loses its control characters
(terminal escapes, carriage returns, bidirectional overrides) and any secret sleuth can recognise (the
value of a secret-looking variable of sleuth's own environment, a private key block, a token shape: see
sleuth.redact) before it can reach stdout, a report or the trace. Anything that fails is one line,
`AnswerError`, which turns every probe `unknown` with that reason.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sleuth.probes.verdict import PROBE_STATUSES, PROBED_INVARIANTS, Verdict
from sleuth.redact import redact

MAX_DEPTH = 32
MAX_VERDICTS = 500
# C0 and C1 controls (tab and newline kept), DEL, and the bidirectional overrides that reorder what a terminal
# or an editor shows ("Trojan source").
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


class AnswerError(ValueError):
    """The answer cannot be used; the message is one line."""


def safe_text(text: str) -> str:
    """`text` without control characters or recognisable secrets: what may be printed or written."""
    return redact(_CONTROL.sub("", text))


class ProbeAnswer(BaseModel):
    """What `sleuth.probes.worker` writes to its OUT.json."""

    model_config = ConfigDict(extra="ignore")

    subject: dict[str, Any] | None = None  # the subject's describe()
    verdicts: list[Verdict] = Field(default_factory=list, max_length=MAX_VERDICTS)
    error: str | None = None  # why no experiment ran
    python: str | None = None
    torch: str | None = None
    seconds: dict[str, float] = Field(default_factory=dict)
    traceback: str | None = None

    @field_validator("verdicts")
    @classmethod
    def _probed_invariants_only(cls, verdicts: list[Verdict]) -> list[Verdict]:
        # A verdict on an invariant no experiment decides (a config-level one) can only be forged.
        for number, verdict in enumerate(verdicts):
            if verdict.status not in PROBE_STATUSES:
                raise ValueError(f"verdict {number}: status {verdict.status!r} is not one of {', '.join(PROBE_STATUSES)}")
            if verdict.invariant not in PROBED_INVARIANTS:
                raise ValueError(f"verdict {number}: {verdict.invariant!r} is not an invariant the probes decide")
        return verdicts


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
        raise AnswerError(f"the probe's answer is {reason}") from None
    if not isinstance(value, dict):
        raise AnswerError(f"the probe's answer is a JSON {type(value).__name__}, not an object")
    if _depth(value) > MAX_DEPTH:
        raise AnswerError(f"the probe's answer is nested deeper than {MAX_DEPTH} levels")
    try:
        return ProbeAnswer.model_validate(_cleaned(value))
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "answer"
        raise AnswerError(safe_text(f"the probe's answer does not follow the schema: {where}: {first.get('msg')}")[:300]) from None


def _cleaned(value: Any) -> Any:
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {safe_text(str(k)): _cleaned(v) for k, v in value.items()}
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


__all__ = ["AnswerError", "ProbeAnswer", "parse_answer", "read_answer", "safe_text"]
