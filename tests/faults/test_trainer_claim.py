"""The run directory is claimed atomically and only ever for the trainer's own runs.

Two `trainer run same` at once: one trains, the other exits 2 and touches nothing (real processes, and
in-process with the lock held). `--fixed` picking the next vN under the same race takes the next number.
A directory that is not a run (a user's project with code/ and metrics.jsonl), a run that lost its
config.json, a damaged run: never written into, never deleted, never appended to.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from trainer_faults import (
    assert_one_line_error,
    copy_base_run,
    debris,
    invoke,
    metric_steps,
    no_traceback,
    snapshot,
    tiny_config,
    trainer_process,
)


def write_config(path: Path, **changes) -> Path:
    path.write_text(json.dumps(tiny_config(**changes)))
    return path


def test_a_held_run_name_makes_the_second_start_exit_2_touching_nothing(tmp_path):
    from trainer.run.rundir import RunDir, RunLock

    runs = tmp_path / "runs"
    config = write_config(tmp_path / "c.json")
    with RunLock(RunDir(runs / "same")):  # another trainer, mid-start, holds the name
        before = snapshot(runs)
        result = invoke("run", "same", "--config", str(config), "--runs-dir", str(runs), "--quiet")
        line = assert_one_line_error(result.stderr, result.exit_code, naming="same")
        assert "in use by another trainer process" in line and f"pid {os.getpid()}" in line
        assert snapshot(runs) == before
        resumed = invoke("run", "same", "--resume", "--runs-dir", str(runs), "--quiet")
        assert "in use" in assert_one_line_error(resumed.stderr, resumed.exit_code)
    assert not (runs / ".same.lock").exists()  # released and removed


def test_the_lock_is_released_after_a_failure(tmp_path):
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "c.json", data=str(tmp_path / "missing.jsonl"))
    for _ in range(2):  # the second attempt is not blocked by the first
        result = invoke("run", "x", "--config", str(config), "--runs-dir", str(runs), "--quiet")
        assert_one_line_error(result.stderr, result.exit_code, naming="missing.jsonl")
    assert sorted(p.name for p in runs.iterdir()) == []  # nothing created: not even the lock file


@pytest.mark.slow
def test_two_real_processes_starting_the_same_run(tmp_path):
    runs = tmp_path / "runs"
    config = write_config(tmp_path / "c.json", steps=6)
    args = ("run", "same", "--config", str(config), "--runs-dir", str(runs), "--quiet")
    first, second = trainer_process(*args), trainer_process(*args)
    outcomes = sorted((p.wait(timeout=300), p.stderr.read()) for p in (first, second))
    (ok_code, _), (lost_code, lost_stderr) = outcomes
    assert ok_code == 0, outcomes
    line = assert_one_line_error(lost_stderr, lost_code)
    assert "in use by another trainer process" in line or "already exists" in line
    assert metric_steps(runs / "same") == [1, 2, 3, 4, 5, 6]  # every row once, never interleaved
    assert debris(runs / "same") == []


def test_fixed_takes_the_next_free_version_when_one_is_held(tmp_path):
    from trainer.run.rundir import RunDir, RunLock, claim_next_version

    runs = tmp_path / "runs"
    (runs / "v1").mkdir(parents=True)
    (runs / "v1" / "config.json").write_text("{}")
    with RunLock(RunDir(runs / "v2")):  # a concurrent --fixed is starting v2
        run, lock = claim_next_version(runs)
        try:
            assert run.name == "v3"
        finally:
            lock.release()


@pytest.mark.slow
def test_two_real_fixed_runs_at_once_get_two_versions(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    tiny = [f"--set={key}={json.dumps(value)}" for key, value in tiny_config(steps=2).items()]
    args = ("run", "--fixed", "--runs-dir", str(runs), "--quiet", *tiny)
    processes = [trainer_process(*args), trainer_process(*args)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in processes]
    assert [code for code, _ in results] == [0, 0], results
    assert sorted(p.name for p in runs.iterdir() if p.is_dir()) == ["v1", "v2"]
    for name in ("v1", "v2"):
        assert metric_steps(runs / name) == [1, 2]


def test_a_directory_that_is_not_a_run_is_never_written_into(tmp_path):
    """`trainer run myproj` where myproj is somebody's folder: refused, every byte left as it was."""
    runs = tmp_path / "runs"
    project = runs / "myproj"
    (project / "code").mkdir(parents=True)
    (project / "code" / "important.py").write_text("print('mine')\n")
    (project / "metrics.jsonl").write_text('{"step": 1, "mine": true}\n')
    before = snapshot(project)
    config = write_config(tmp_path / "c.json")
    for args in (["--config", str(config)], ["--resume"]):
        result = invoke("run", "myproj", *args, "--runs-dir", str(runs), "--quiet")
        line = assert_one_line_error(result.stderr, result.exit_code, naming="myproj")
        assert "not a trainer run" in line or "nothing to resume" in line
        assert snapshot(project) == before


def test_a_run_that_lost_its_config_is_never_overwritten(tmp_path):
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs, "lost")
    (run_dir / "config.json").unlink()
    before = snapshot(run_dir)
    config = write_config(tmp_path / "c.json")
    fresh = invoke("run", "lost", "--config", str(config), "--runs-dir", str(runs), "--quiet")
    line = assert_one_line_error(fresh.stderr, fresh.exit_code, naming="config.json")
    assert "refusing to overwrite" in line
    resumed = invoke("run", "lost", "--resume", "--runs-dir", str(runs), "--quiet")
    assert "lost its config.json" in assert_one_line_error(resumed.stderr, resumed.exit_code)
    assert snapshot(run_dir) == before  # latest still names a checkpoint that exists
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest / "drafter.safetensors").is_file()


def test_an_existing_run_is_never_overwritten(tmp_path):
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs, "done")
    before = snapshot(run_dir)
    result = invoke("run", "done", "--config", str(write_config(tmp_path / "c.json")), "--runs-dir", str(runs))
    assert "already exists" in assert_one_line_error(result.stderr, result.exit_code)
    assert snapshot(run_dir) == before


def test_a_new_run_may_use_an_empty_directory(tmp_path):
    runs = tmp_path / "runs"
    (runs / "empty").mkdir(parents=True)
    result = invoke("run", "empty", "--config", str(write_config(tmp_path / "c.json", steps=2)),
                    "--runs-dir", str(runs), "--quiet")
    assert result.exit_code == 0, result.output
    no_traceback(result.output)
    assert metric_steps(runs / "empty") == [1, 2]
    assert json.loads((runs / "empty" / "run.json").read_text())["status"] == "completed"


def test_a_link_out_of_the_run_is_never_appended_to(tmp_path):
    """metrics.jsonl replaced by a link to a user's file: resume refuses instead of appending to it."""
    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    users_file = tmp_path / "users-notes.jsonl"
    users_file.write_text('{"step": 1, "note": "mine"}\n')
    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").symlink_to(users_file)
    result = invoke("run", "r", "--resume", "--steps", "6", "--runs-dir", str(runs), "--quiet")
    assert "outside the run directory" in assert_one_line_error(result.stderr, result.exit_code,
                                                                naming="metrics.jsonl")
    assert users_file.read_text() == '{"step": 1, "note": "mine"}\n'
