"""Training curves a foreign trainer logged to tensorboard (`speculators train --logger tensorboard`).

Event files are read only with tensorboard's own reader (`EventAccumulator`), never parsed by hand. Where
speculators puts them: `--log-dir` (default `./logs`) / `--run-name` (`train/logger.py`), relative to
where training ran; so they are looked for inside the save directory, and in `<log_dir>/<run_name>` beside
it (both read from run.yaml / train_command.txt). Tags are speculators' metric dict flattened with "/":
`train/loss`, `train/full_acc`, `train/position_{k}_acc`, `train/eal` per logged step, `val/loss_epoch`,
... per epoch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sleuth.artifacts import find_files, is_dir, is_within, shown

_MAX_EVENT_FILES = 50
# How far a log dir is searched: speculators nests one folder (the run name), SpecForge none.
_MAX_DEPTH = 3
_MAX_ENTRIES = 5_000
_MAX_EVENT_FILE_BYTES = 512 * 1024 * 1024
_TRAIN = {"train/loss": "loss", "train/full_acc": "acc", "train/eal": "eal"}
_POSITION = re.compile(r"^train/position_(\d{1,6})_acc$")


@dataclass
class Scalars:
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    problem: str | None = None


def event_files(run: Any) -> tuple[list[Path], list[str]]:
    """The event files of a speculators run, and a line for each place not looked in (and why)."""
    roots = [run.path]
    notes: list[str] = []
    if run.kind == "save_dir":
        log_dir = _setting(run, "log_dir", "--log-dir") or "logs"
        run_name = _setting(run, "run_name", "--run-name")
        base = Path(log_dir) if Path(log_dir).is_absolute() else run.path.parent / log_dir
        roots.append(base / run_name if run_name else base / run.path.name)
    found: list[Path] = []
    for root in roots:
        files, problem = find_event_files(root, near=run.path)
        found += files
        if problem:
            notes.append(problem)
    return sorted(set(found))[:_MAX_EVENT_FILES], notes


def find_event_files(root: Path, *, near: Path) -> tuple[list[Path], str | None]:
    """Event files under `root` (regular files, no link followed, a bounded walk), and why a root was
    not (fully) searched. A root that contains the folder the run sits in (`/`, the home directory, the
    runs folder itself) would read other runs' curves as this run's: it is not searched at all."""
    if not is_dir(root):
        return [], None
    run_parent = os.path.realpath(near.parent if near.parent != near else near)
    if is_within(Path(run_parent), root):
        return [], (f"tensorboard log dir {shown(root)} contains the folder this run sits in; not searched "
                    "(its event files could be any run's)")
    files, cut = find_files(root, lambda name: name.startswith("events.out.tfevents."), max_depth=_MAX_DEPTH,
                            max_entries=_MAX_ENTRIES)
    large = [f for f in files if _size(f) > _MAX_EVENT_FILE_BYTES]
    files = [f for f in files if f not in large]
    notes = []
    if cut:
        notes.append(f"stopped after {_MAX_ENTRIES} entries")
    if large:
        notes.append(f"{len(large)} event file(s) over {_MAX_EVENT_FILE_BYTES >> 20} MiB skipped")
    if len(files) > _MAX_EVENT_FILES:
        notes.append(f"only the first {_MAX_EVENT_FILES} of {len(files)} event files read")
    return files[:_MAX_EVENT_FILES], (f"tensorboard log dir {shown(root)}: " + "; ".join(notes)) if notes else None


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def read_scalars(run: Any) -> Scalars:
    """Per-step training metrics, in sleuth's names (loss, acc, eal, position_acc), from every event file."""
    files, notes = event_files(run)
    if not files:
        return Scalars(problem="; ".join(notes) or None)
    accumulators, problem = _load(files)
    problem = "; ".join([*notes, *([problem] if problem else [])]) or None
    if not accumulators:  # the other sources (val_metrics) still count
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
    return Scalars(rows=rows, files=files, problem=problem)


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
    """tensorboard's own reader over each file, in order; the files it cannot read (tensorboard not
    installed, a torn or foreign file, a name that is not UTF-8) are skipped and named in one line."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return [], (f"{len(files)} tensorboard event file(s) not read: the tensorboard package is not installed "
                    "(pip install tensorboard)")
    loaded, failed = [], []
    for path in files:
        try:
            accumulator = EventAccumulator(str(path), size_guidance={"scalars": 0})
            accumulator.Reload()
        except Exception as exc:  # any reader failure is the file's (a torn file, a name not UTF-8), not ours
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            failed.append(f"{shown(path.name)} cannot be read by tensorboard: {first[:200]}")
            continue
        loaded.append(accumulator)
    if not failed:
        return loaded, None
    return loaded, "; ".join(failed[:3]) + (f"; and {len(failed) - 3} more" if len(failed) > 3 else "")
