"""A full disk: one line naming the file that could not be written, exit 2, and the run resumes once there
is space. For real on a small tmpfs where this machine lets us mount one (root, CAP_SYS_ADMIN), and by
injecting ENOSPC into the metrics writer everywhere."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from trainer_faults import assert_one_line_error, copy_base_run, debris, invoke, metric_steps, tiny_config


def test_enospc_while_appending_metrics_is_one_line_and_resumable(tmp_path, monkeypatch):
    from trainer.run import rundir

    runs = tmp_path / "runs"
    run_dir = copy_base_run(runs)
    real_write = os.write

    def full_disk_write(fd, data):
        if data.startswith(b'{"step": 6'):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run_dir / "metrics.jsonl"))
        return real_write(fd, data)

    monkeypatch.setattr(rundir.os, "write", full_disk_write)
    result = invoke("run", "r", "--resume", "--steps", "8", "--runs-dir", str(runs), "--quiet")
    line = assert_one_line_error(result.stderr, result.exit_code, naming="metrics.jsonl")
    assert line.startswith("error: disk full writing") and "--resume" in line
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    monkeypatch.undo()

    resumed = invoke("run", "r", "--resume", "--steps", "8", "--runs-dir", str(runs), "--quiet")
    assert resumed.exit_code == 0, resumed.output
    assert metric_steps(run_dir) == list(range(1, 9))


@pytest.fixture
def small_disk(tmp_path) -> Path:
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a real full disk needs a tmpfs mount: not root here")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount_point)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode})")
    yield mount_point
    subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.slow
def test_a_real_full_disk_mid_run_then_resume_with_space(small_disk, tmp_path):
    """3 MB of tmpfs: the run's code copy (~0.3 MB) and two checkpoints (~1.3 MB each) fit, the third does not."""
    runs = small_disk / "runs"
    config = tmp_path / "c.json"
    config.write_text(json.dumps(tiny_config(steps=8, checkpoint_every=2, keep_checkpoints=3)))
    result = invoke("run", "full", "--config", str(config), "--runs-dir", str(runs), "--quiet")
    line = assert_one_line_error(result.stderr, result.exit_code)
    assert line.startswith("error: disk full writing"), line
    run_dir = runs / "full"
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest / "state.json").is_file()  # the last good checkpoint is intact

    # Make room: move the run to a roomy disk, then resume it there.
    roomy = tmp_path / "runs"
    shutil.copytree(runs, roomy, symlinks=True)
    resumed = invoke("run", "full", "--resume", "--runs-dir", str(roomy), "--quiet")
    assert resumed.exit_code == 0, resumed.output
    assert metric_steps(roomy / "full") == list(range(1, 9))
    assert debris(roomy / "full") == []
