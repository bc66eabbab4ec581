"""`RunInfo`: what sleuth read from one run directory, whoever wrote it.

Its own module because two kinds of readers build it: `sleuth.runs` (the run-directory contract) and
`sleuth.interop` (speculators and SpecForge layouts), and `sleuth.runs` dispatches to `sleuth.interop`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# Metric values past this magnitude are not measurements (an accuracy, a loss, a streak) but overflow or
# corruption; keeping them would overflow the chart's axis arithmetic and the regression's differences.
# Steps past MAX_STEP likewise. Both are part of the run-directory contract as sleuth reads it.
MAX_METRIC_MAGNITUDE = 1e15
MAX_STEP = 10**12


@dataclass
class RunInfo:
    """Everything sleuth read from one run directory, with a reason for each thing it could not read."""

    name: str
    path: Path
    run_json: dict[str, Any] | None = None
    config: dict[str, Any] | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    metrics_sha256: str | None = None
    config_sha256: str | None = None  # of config.json's bytes, as read: fix.yaml says which config it patches
    eval_report: dict[str, Any] | None = None
    checkpoint: Path | None = None
    checkpoint_step: int | None = None
    code_dir: Path | None = None
    problems: list[str] = field(default_factory=list)
    # Problems that leave the checks unable to say the run is clean (a settings record that cannot be read,
    # a field of the wrong type): the diagnosis exits 1 for them, as for a mismatch. Also in `problems`.
    input_problems: list[str] = field(default_factory=list)
    # What another trainer's reader (sleuth.interop) read, for checks in that trainer's conventions.
    interop: Any = None

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def created(self) -> datetime | None:
        raw = (self.run_json or {}).get("created")
        if not isinstance(raw, str):
            return None
        try:
            created = datetime.fromisoformat(raw.replace("Z", "+00:00"))
        except ValueError:
            return None
        # Naive and aware timestamps cannot be compared; treat a naive one as UTC, as the trainer writes UTC.
        if created.tzinfo is None:
            created = created.replace(tzinfo=timezone.utc)
        return created

    @property
    def target_fingerprint(self) -> str | None:
        return _nested_str(self.run_json, "target", "fingerprint")

    @property
    def data_fingerprint(self) -> str | None:
        return _nested_str(self.run_json, "data", "fingerprint")

    @property
    def block_size(self) -> int | None:
        value = (self.config or {}).get("block_size")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def status(self) -> str | None:
        value = (self.run_json or {}).get("status")
        return value if isinstance(value, str) else None

    @property
    def steps_done(self) -> int | None:
        value = (self.run_json or {}).get("steps_done")
        return value if isinstance(value, int) else None

    def series(self, metric: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric, in step order; rows without a finite number for it are skipped.

        A step logged twice (a resumed run re-logs the steps after its checkpoint) keeps the later row.
        `val_<name>` reads the validation rows (`"split": "val"`, held-out data); any other name reads the
        training rows (no `split`, or `"split": "train"`), so the two never overwrite each other.
        """
        split = "val" if metric.startswith("val_") else "train"
        name = metric.removeprefix("val_")
        by_step: dict[int, float] = {}
        for row in self.metrics:
            if row.get("split", "train") != split:
                continue
            step, value = row.get("step"), metric_value(row.get(name))
            if not is_step(step) or value is None:
                continue
            by_step[step] = value
        steps = sorted(by_step)
        return steps, [by_step[s] for s in steps]


def metric_value(value: object) -> float | None:
    """The value as a float when it is a usable measurement: a finite number within ±MAX_METRIC_MAGNITUDE."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)  # an int of 400 digits overflows here rather than later
    except OverflowError:
        return None
    return number if math.isfinite(number) and abs(number) <= MAX_METRIC_MAGNITUDE else None


def is_step(step: object) -> bool:
    return isinstance(step, int) and not isinstance(step, bool) and 0 <= step <= MAX_STEP


def _nested_str(data: dict[str, Any] | None, *keys: str) -> str | None:
    value: Any = data
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value if isinstance(value, str) and value else None
