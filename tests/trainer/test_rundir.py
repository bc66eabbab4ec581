"""The run directory survives kills: atomic checkpoints, whole metric rows, exact truncation on resume."""

import json
import os

import pytest
import torch
from safetensors import safe_open

from trainer.run.checkpoint import latest_checkpoint, restore_training_state, save_checkpoint
from trainer.run.rundir import RunDir, next_version_name


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_torn_metrics_line_is_dropped_and_truncation_keeps_whole_rows(tmp_path):
    run = RunDir(tmp_path / "v1")
    run.path.mkdir()
    for step in (10, 20, 30):
        run.append_metrics({"step": step, "loss": 1.0 / step, "acc": 0.1})
    with open(run.metrics_path, "a") as handle:
        handle.write('{"step": 40, "loss": 0.0')  # a kill in the middle of a write
    assert [r["step"] for r in run.read_metrics()] == [10, 20, 30]
    assert run.truncate_metrics(20) == 2
    assert [json.loads(line)["step"] for line in run.metrics_path.read_text().splitlines()] == [10, 20]


def test_checkpoint_round_trip_restores_optimizer_and_rng(tmp_path):
    model, optimizer = _model_and_optimizer()
    torch.manual_seed(123)
    path = save_checkpoint(tmp_path / "checkpoints", 7, model, optimizer, {"note": "x"}, keep=2)
    expected_draw = torch.rand(3)

    with safe_open(str(path / "drafter.safetensors"), "pt") as handle:
        assert sorted(handle.keys()) == ["bias", "weight"]

    fresh, fresh_optimizer = _model_and_optimizer(seed=1)
    checkpoint = latest_checkpoint(tmp_path / "checkpoints")
    assert checkpoint.step == 7 and checkpoint.state["note"] == "x"
    restore_training_state(checkpoint, fresh_optimizer)
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where it was saved
    saved_state, restored_state = optimizer.state_dict(), fresh_optimizer.state_dict()
    for index, fields in saved_state["state"].items():
        for field, value in fields.items():
            assert torch.equal(torch.as_tensor(restored_state["state"][index][field]), torch.as_tensor(value))
    assert restored_state["param_groups"] == saved_state["param_groups"]


def test_a_half_written_checkpoint_never_becomes_latest(tmp_path):
    model, optimizer = _model_and_optimizer()
    checkpoints = tmp_path / "checkpoints"
    save_checkpoint(checkpoints, 5, model, optimizer, {}, keep=2)
    # A kill while step 10 is being staged leaves only the staging dir behind.
    staging = checkpoints / ".step-00000010.partial"
    staging.mkdir()
    (staging / "drafter.safetensors").write_bytes(b"\x00\x01")
    assert latest_checkpoint(checkpoints).step == 5
    # The next save of step 10 replaces the debris.
    save_checkpoint(checkpoints, 10, model, optimizer, {}, keep=2)
    assert latest_checkpoint(checkpoints).step == 10
    assert not staging.exists()


def test_old_checkpoints_are_pruned(tmp_path):
    model, optimizer = _model_and_optimizer()
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, model, optimizer, {}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000003", "step-00000004"]


def test_code_fingerprint_copies_the_trainer_source(tmp_path):
    run = RunDir(tmp_path / "v1")
    run.path.mkdir()
    fingerprint = run.write_code_fingerprint()
    assert "trainer/config.py" in fingerprint["files"]
    copied = run.path / "code" / "trainer" / "config.py"
    assert copied.is_file()
    import hashlib

    assert hashlib.sha256(copied.read_bytes()).hexdigest() == fingerprint["files"]["trainer/config.py"]


def test_next_version_name(tmp_path):
    assert next_version_name(tmp_path) == "v1"
    for name in ("v3", "v5", "v6", "fixed", "v10x"):
        os.mkdir(tmp_path / name)
    assert next_version_name(tmp_path) == "v7"


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    from trainer.config import TrainConfig
    from trainer.run.loop import lr_at

    config = TrainConfig(lr=1e-3, warmup_steps=10, steps=110, min_lr_ratio=0.1, schedule="cosine")
    assert lr_at(config, 5) == pytest.approx(5e-4)  # linear warmup
    assert lr_at(config, 10) == pytest.approx(1e-3)
    assert lr_at(config, 60) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # cosine half-way
    assert lr_at(config, 110) == pytest.approx(1e-4)  # the floor at the last step
    linear = config.model_copy(update={"schedule": "linear"})
    assert lr_at(linear, 60) == pytest.approx(1e-4 + 0.9e-3 * 0.5)
    constant = config.model_copy(update={"schedule": "constant"})
    assert lr_at(constant, 100) == pytest.approx(1e-3)


def test_runs_table_shows_run_json_text_escaped_never_as_markup_or_terminal_codes(tmp_path):
    """A run directory shipped by someone else: its run.json strings reach the terminal only as escaped text."""
    import subprocess
    import sys

    from trainer.config import validate_config

    run = tmp_path / "runs" / "v1"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(validate_config({}).model_dump(mode="json")))
    (run / "run.json").write_text(json.dumps({"format_version": 1, "name": "v1", "preset": "\x1b]0;t\x07[/]\u202e",
                                              "status": "done\u2028", "created": "2026-11-01T10:00:00+00:00",
                                              "steps_done": 1}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "trainer.cli", "runs", "--runs-dir", str(tmp_path / "runs")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "\x1b" not in done.stdout and "\x07" not in done.stdout and "\u202e" not in done.stdout
    assert "\u2028" not in done.stdout
    assert "\\x1b]0;t\\x07[/]\\u202e" in done.stdout and "done\\u2028" in done.stdout
