"""Validation rows (`split: val`) on held-out documents, and the TensorBoard tracker read back with
TensorBoard's own event reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.config import ConfigError, build_config
from trainer.run.trackers import require_trackers, scalars

# The embedded target's small twin and the trainer CLI in a subprocess, shared with the end-to-end tests.
from test_train_e2e import small_target, trainer_cli  # noqa: F401 (small_target is a fixture)


def tiny(target: Path, runs: Path, *extra: str) -> list[str]:
    sets = {"target": str(target), "seq_len": 64, "batch_size": 2, "block_size": 4, "max_anchors": 4,
            "draft_layers": 2, "eval_every": "null", "log_every": 1, "checkpoint_every": 2, "warmup_steps": 1,
            "val_every": 2, "val_batches": 2, "eval_prompts": 1, "eval_max_new_tokens": 4}
    return [*(a for k, v in sets.items() for a in ("--set", f"{k}={v}")), "--runs-dir", str(runs), "--quiet", *extra]


def rows(run: Path, split: str | None) -> list[dict]:
    out = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in out if r.get("split") == split]


@pytest.mark.slow
def test_val_rows_are_written_on_schedule_and_resume_exactly(small_target, tmp_path):
    runs = tmp_path / "runs"
    assert trainer_cli("run", "straight", *tiny(small_target, runs, "--steps", "4")).returncode == 0
    val = rows(runs / "straight", "val")
    assert [r["step"] for r in val] == [2, 4]
    for row in val:
        assert set(row) >= {"loss", "acc", "position_acc", "streak", "eal"} and len(row["position_acc"]) == 3
        assert row["loss"] > 0
    # training rows are unchanged in shape: one per step, no split key
    assert [r["step"] for r in rows(runs / "straight", None)] == [1, 2, 3, 4]

    half = trainer_cli("run", "halves", *tiny(small_target, runs, "--steps", "2", "--set", "schedule=constant"))
    assert half.returncode == 0, half.stderr
    straight_const = trainer_cli("run", "const", *tiny(small_target, runs, "--steps", "4", "--set", "schedule=constant"))
    assert straight_const.returncode == 0
    resumed = trainer_cli("run", "halves", "--resume", "--steps", "4", "--runs-dir", str(runs), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    strip = lambda rs: [{k: v for k, v in r.items() if k not in ("elapsed_s", "tokens_per_s")} for r in rs]  # noqa: E731
    assert strip(rows(runs / "halves", "val")) == strip(rows(runs / "const", "val"))


def test_scalars_name_every_number_by_split():
    row = {"step": 5, "split": "val", "loss": 1.5, "position_acc": [0.5, 0.25], "tau": None, "acc": 0.4}
    assert scalars(row, "val") == {"val/loss": 1.5, "val/position_acc/1": 0.5, "val/position_acc/2": 0.25,
                                   "val/acc": 0.4}


def test_a_missing_tracker_library_is_one_line_before_the_run(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        require_trackers(build_config(overrides=["report_to=[wandb]"]))


@pytest.mark.slow
def test_tensorboard_events_hold_the_metrics_rows(small_target, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is in the test extras; install them to run this")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = tmp_path / "runs"
    result = trainer_cli("run", "tb", *tiny(small_target, runs, "--steps", "2", "--set", "report_to=[tensorboard]"))
    assert result.returncode == 0, result.stderr
    events = EventAccumulator(str(runs / "tb" / "tensorboard"))
    events.Reload()
    train = {r["step"]: r["loss"] for r in rows(runs / "tb", None)}
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert logged == pytest.approx(train, rel=1e-6)
    assert [e.step for e in events.Scalars("val/acc")] == [2]
