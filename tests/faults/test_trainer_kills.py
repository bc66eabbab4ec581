"""SIGKILL at random moments of a real training process, then resume: the metrics equal those of a run that
was never interrupted (no row lost, none twice) and no temporary file is left behind."""

from __future__ import annotations

import json
import random
import signal
import time

import pytest
from trainer_faults import debris, metric_steps, run_trainer, tiny_config, trainer_process

KILLS = 4
STEPS = 16
SEED = 1515


def comparable(run_dir) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["acc"], r["streak"], r["lr"]) for r in rows]


def wait_for_training(process, run_dir, timeout: float = 240) -> None:
    """Until the process has written its run header (start-up, which the machine's load stretches, is over)."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        info = run_dir / "run.json"
        if info.exists() and '"running"' in info.read_text(errors="replace"):
            return
        time.sleep(0.02)


@pytest.mark.slow
def test_kills_at_random_points_then_resume_equals_an_uninterrupted_run(tmp_path):
    runs = tmp_path / "runs"
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_config(steps=STEPS, checkpoint_every=3)))
    straight = run_trainer("run", "straight", "--config", str(config), "--runs-dir", str(runs), "--quiet")
    assert straight.returncode == 0, straight.stderr

    chance = random.Random(SEED)
    killed = runs / "killed"
    kills_while_running = 0
    for attempt in range(KILLS):
        started = (killed / "config.json").exists()
        args = ("run", "killed", "--resume") if started else ("run", "killed", "--config", str(config))
        process = trainer_process(*args, "--runs-dir", str(runs), "--quiet")
        if attempt:  # the first kill lands anywhere in start-up; the others once training is under way
            wait_for_training(process, killed)
        time.sleep(chance.uniform(0.0, 1.5))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            kills_while_running += 1
        process.wait()
    assert kills_while_running >= KILLS - 1
    args = ("run", "killed", "--resume") if (killed / "config.json").exists() else (
        "run", "killed", "--config", str(config))
    resumed = run_trainer(*args, "--runs-dir", str(runs), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert comparable(killed) == comparable(runs / "straight")
    assert metric_steps(killed) == list(range(1, STEPS + 1))
    assert debris(killed) == []
    assert json.loads((killed / "run.json").read_text())["status"] == "completed"
