"""Optional metric trackers (`report_to`): TensorBoard and Weights & Biases, through their own libraries.

metrics.jsonl stays the record (sleuth reads it); a tracker is a copy for people who watch runs in those
tools. A tracker whose library is missing stops the run before it starts, with one line naming the
package to install, never halfway through. wandb runs offline unless WANDB_MODE says otherwise, since a
trainer must not open sockets its user did not ask for.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

from trainer.config import ConfigError, TrainConfig
from trainer.run.rundir import RunDir


class Tracker(Protocol):
    def log(self, row: dict[str, Any], split: str) -> None: ...

    def close(self) -> None: ...


class Trackers:
    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers

    def log(self, row: dict[str, Any], split: str) -> None:
        for tracker in self.trackers:
            tracker.log(row, split)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def scalars(row: dict[str, Any], split: str) -> dict[str, float]:
    """`train/loss`, `val/acc`, `train/position_acc/3`, ...: every number of a metrics row."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in ("step", "split") or value is None or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[f"{split}/{key}"] = float(value)
        elif isinstance(value, list):
            for slot, item in enumerate(value, start=1):  # position_acc lists slots 1..B-1
                if isinstance(item, (int, float)):
                    out[f"{split}/{key}/{slot}"] = float(item)
    return out


class TensorBoardTracker:
    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, row: dict[str, Any], split: str) -> None:
        for name, value in scalars(row, split).items():
            self.writer.add_scalar(name, value, global_step=int(row["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run: RunDir, config: TrainConfig) -> None:
        os.environ.setdefault("WANDB_MODE", "offline")
        import wandb

        self.run = wandb.init(project="dflash-trainer", name=run.name, dir=str(run.path),
                              config=config.model_dump(mode="json"), reinit=True)

    def log(self, row: dict[str, Any], split: str) -> None:
        self.run.log(scalars(row, split), step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


REQUIRED_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def require_trackers(config: TrainConfig) -> None:
    """Fail before the run starts when a requested tracker's library is missing."""
    import importlib.util

    for name in config.report_to:
        if importlib.util.find_spec(REQUIRED_MODULES[name]) is None:
            raise ConfigError(
                f"report_to lists {name!r} but its library is not installed: pip install {REQUIRED_MODULES[name]}"
            )


def open_trackers(config: TrainConfig, run: RunDir) -> Trackers:
    require_trackers(config)
    opened: list[Tracker] = []
    for name in config.report_to:
        if name == "tensorboard":  # event files under the run, next to metrics.jsonl
            opened.append(TensorBoardTracker(str(run.path / "tensorboard")))
        else:
            opened.append(WandbTracker(run, config))
    return Trackers(opened)
