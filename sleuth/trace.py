"""The investigation's log: every step sleuth takes, with its inputs, outcome and duration.

Steps are shown live (on stderr, through an optional listener) and saved as JSONL beside the report, so a
reader can replay how each conclusion was reached.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from sleuth.findings import TraceStep
from sleuth.redact import redact, redact_data


class Trace:
    def __init__(self, listener: Callable[[TraceStep], None] | None = None) -> None:
        self.steps: list[TraceStep] = []
        self._listener = listener

    @contextmanager
    def step(self, name: str, **inputs: object) -> Iterator[TraceStep]:
        """Time a step; the body sets `.outcome`. An exception is recorded, then re-raised."""
        # Inputs and outcomes can name a remote URL; they are shown live and saved, so redacted here.
        record = TraceStep(step=name, inputs={k: redact_data(_jsonable(v)) for k, v in inputs.items()})
        start = time.perf_counter()
        try:
            yield record
        except BaseException as exc:
            record.outcome = record.outcome or f"error: {exc}"
            raise
        finally:
            record.outcome = redact(record.outcome)
            record.duration_s = round(time.perf_counter() - start, 6)
            self.steps.append(record)
            if self._listener is not None:
                self._listener(record)

    def write_jsonl(self, path: Path) -> None:
        """One strict JSON object per line (sleuth.escape.dumps: a NaN or infinite input is null, a control or
        invisible character in a name a `\\uXXXX` escape), so every line parses with a strict parser."""
        # Written by rename (sleuth.artifacts.write_atomic): a trace.jsonl that is a link is replaced, not followed.
        from sleuth.artifacts import write_atomic
        from sleuth.escape import dumps

        write_atomic(path, "".join(redact(dumps(s.model_dump(mode="json"))) + "\n" for s in self.steps))


def _jsonable(value: object) -> object:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)
