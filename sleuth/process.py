"""A helper program run to completion, bounded in time, and never outliving sleuth's patience.

git (sleuth/reference/gitsafe.py) and the probe interpreter's start-up check (sleuth/probes/sandbox.py) both run
a program whose children may hold its pipes: a wrapper script's subprocess, git's `ssh` or `remote-https`. So the
program gets a process group of its own, and at the deadline (or on any error while waiting) the whole group is
killed, not just the direct child that `communicate(timeout=...)` would leave behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def run_in_own_group(command: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> tuple[int, bytes, bytes]:
    """(exit status, stdout, stderr) of `command`, stdin closed. Raises OSError when it cannot start and
    subprocess.TimeoutExpired (its group killed) when it runs past `timeout` seconds."""
    process = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except BaseException:
        kill_group(process)
        raise
    return process.returncode, out, err


def kill_group(process: subprocess.Popen) -> None:
    """SIGKILL the process's whole group, then reap it and drain its pipes (nothing of the group holds them now)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        process.communicate(timeout=5)
    except (subprocess.TimeoutExpired, ValueError, OSError):
        process.kill()
        process.wait()
