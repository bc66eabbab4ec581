"""Training curves a foreign trainer logged to tensorboard (`speculators train --logger tensorboard`).

Event files are read only with tensorboard's own reader (`EventAccumulator`), never parsed by hand. Where
speculators puts them: `--log-dir` (default `./logs`) / `--run-name` (`train/logger.py`), relative to
where training ran; so they are looked for inside the save directory, and in `<log_dir>/<run_name>` beside
it (both read from run.yaml / train_command.txt). Tags are speculators' metric dict flattened with "/":
`train/loss`, `train/full_acc`, `train/position_{k}_acc`, `train/eal` per logged step, `val/loss_epoch`,
... per epoch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_MAX_EVENT_FILES = 50
_TRAIN = {"train/loss": "loss", "train/full_acc": "acc", "train/eal": "eal"}
_POSITION = re.compile(r"^train/position_(\d+)_acc$")


@dataclass
class Scalars:
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    problem: str | None = None


def event_files(run: Any) -> list[Path]:
    roots = [run.path]
    if run.kind == "save_dir":
        log_dir = _setting(run, "log_dir", "--log-dir") or "logs"
        run_name = _setting(run, "run_name", "--run-name")
        base = Path(log_dir) if Path(log_dir).is_absolute() else run.path.parent / log_dir
        roots.append(base / run_name if run_name else base / run.path.name)
    found: list[Path] = []
    for root in roots:
        if root.is_dir():
            found += sorted(root.rglob("events.out.tfevents.*"))[:_MAX_EVENT_FILES]
    return sorted(set(found))


def read_scalars(run: Any) -> Scalars:
    """Per-step training metrics, in sleuth's names (loss, acc, eal, position_acc), from every event file."""
    files = event_files(run)
    if not files:
        return Scalars()
    accumulators, problem = _load(files)
    if problem is not None:  # the other sources (val_metrics) still count
        return Scalars(files=files, problem=problem)
    rows: dict[int, dict[str, Any]] = {}
    positions: dict[int, dict[int, float]] = {}
    for accumulator in accumulators:
        for tag in accumulator.Tags().get("scalars", []):
            name = _TRAIN.get(tag)
            position = _POSITION.match(tag)
            if name is None and position is None:
                continue
            for event in accumulator.Scalars(tag):
                if position is not None:
                    positions.setdefault(event.step, {})[int(position.group(1))] = float(event.value)
                else:
                    rows.setdefault(event.step, {})[name] = float(event.value)
    for step, by_slot in positions.items():
        rows.setdefault(step, {})["position_acc"] = [by_slot[k] for k in sorted(by_slot)]
    return Scalars(rows=rows, files=files)


def _setting(run: Any, key: str, flag: str) -> str | None:
    given = run.train_arg(flag)
    if given:
        return given[0]
    found = run.run_setting(key)
    return str(found[1]) if found is not None and found[1] else None


def read_tagged_scalars(files: list[Path], tags: dict[str, str]) -> Scalars:
    """Scalars of the given tags (tag -> sleuth's name) per step, from every event file, with tensorboard's
    own reader; a trainer that logs its own tag names (SpecForge: `train/acc`, `eval/avg_loss`) maps them here."""
    files = files[:_MAX_EVENT_FILES]
    if not files:
        return Scalars()
    accumulators, problem = _load(files)  # a torn or foreign file: reported, the files before it kept
    rows: dict[int, dict[str, Any]] = {}
    for accumulator in accumulators:
        for tag in accumulator.Tags().get("scalars", []):
            name = tags.get(tag)
            if name is None:
                continue
            for event in accumulator.Scalars(tag):
                rows.setdefault(event.step, {})[name] = float(event.value)
    return Scalars(rows=rows, files=files, problem=problem)


def _load(files: list[Path]) -> tuple[list[Any], str | None]:
    """tensorboard's own reader over each file, in order, up to the first that cannot be read; the problem
    (tensorboard not installed, a torn or foreign file) as one line."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return [], (f"{len(files)} tensorboard event file(s) not read: the tensorboard package is not installed "
                    "(pip install tensorboard)")
    loaded = []
    for path in files:
        accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
        try:
            accumulator.Reload()
        except Exception as exc:  # any reader failure is the file's, not ours
            return loaded, f"{path.name} cannot be read by tensorboard: {exc}"
        loaded.append(accumulator)
    return loaded, None
