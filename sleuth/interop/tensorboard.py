"""Training curves a foreign trainer logged to tensorboard (`speculators train --logger tensorboard`).

Event files are read only with tensorboard's own reader (`EventAccumulator`), never parsed by hand; without
the `tensorboard` package the files are named in a problem line and the per-checkpoint numbers stand alone.
Where speculators puts them: `--log-dir` (default `./logs`) / run name, so they are looked for inside the
save directory and in a `logs/` folder beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_MAX_EVENT_FILES = 50


@dataclass
class Scalars:
    rows: dict[int, dict[str, float]] = field(default_factory=dict)
    problem: str | None = None


def event_files(run: Any) -> list[Path]:
    roots = [run.path]
    if run.kind == "save_dir":
        roots.append(run.path.parent / "logs")
    found: list[Path] = []
    for root in roots:
        if root.is_dir():
            found += sorted(root.rglob("events.out.tfevents.*"))[:_MAX_EVENT_FILES]
    return found


def read_scalars(run: Any) -> Scalars:
    files = event_files(run)
    if not files:
        return Scalars()
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: F401
    except ImportError:
        return Scalars(problem=f"{len(files)} tensorboard event file(s) not read: the tensorboard package is not installed")
    return Scalars(problem=f"{len(files)} tensorboard event file(s) found; reading them is not implemented yet")
