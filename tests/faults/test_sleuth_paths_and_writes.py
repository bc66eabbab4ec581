"""What sleuth writes, and paths the user names, by class (each case a real process with a deadline, so a
regression fails instead of hanging the suite):

  * writes: `probe init` beside someone's code, where the code tree planted a link to the user's file, a
    dangling link out of the tree, or a FIFO (with and without --force, and as --out): refused in one line,
    the user's file byte-identical, nothing created outside the tree, never blocked; a regular file is still
    replaced with --force;
  * named paths: a FIFO or a device given as --code / --config to `diagnose`, `probe init`, `probe check`:
    one line, exit 2, nothing opened;
  * permission: an unreadable run directory, code tree, code/ or checkpoint is "permission denied: PATH",
    never "not a run directory", "0 Python files" or "No such file" (run in a user namespace when the tests
    run as root, since root reads everything);
  * deep JSON in every file sleuth parses from a run or a code tree: a bounded one-line error naming the file;
  * a metrics.jsonl of 64 MiB of blank lines: streamed, diagnosed in bounded time.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sleuth_helpers import ROOT, write_run

DEADLINE_S = 60


def sleuth(*args: str, cwd: Path, prefix: list[str] | None = None, timeout: float = DEADLINE_S,
           ) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLEUTH_CACHE_DIR": str(cwd / "cache"),
           "SLEUTH_CONFIG_FILE": str(cwd / "no-config.yaml"), "MPLCONFIGDIR": str(cwd / "mpl")}
    return subprocess.run([*(prefix or []), sys.executable, "-m", "sleuth.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def one_line(done: subprocess.CompletedProcess, code: int = 2) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == code, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "Traceback" not in done.stderr and "internal error" not in done.stderr
    return lines[0]


def code_tree(root: Path) -> Path:
    code = root / "code"
    code.mkdir(parents=True)
    (code / "drafter.py").write_text("BLOCK_SIZE = 8\n\ndef decay(k, gamma=4.0):\n    return k / gamma\n")
    return code


# --- writes ---------------------------------------------------------------------------------------------

def plant_link_to_user_file(code: Path, victim: Path, outside: Path) -> Path:
    (code / "probe_entry.py").symlink_to(victim)
    return code / "probe_entry.py"


def plant_dangling_link(code: Path, victim: Path, outside: Path) -> Path:
    (code / "probe_entry.py").symlink_to(outside / "created.py")
    return code / "probe_entry.py"


def plant_fifo(code: Path, victim: Path, outside: Path) -> Path:
    os.mkfifo(code / "probe_entry.py")
    return code / "probe_entry.py"


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
@pytest.mark.parametrize("plant", [plant_link_to_user_file, plant_dangling_link, plant_fifo],
                         ids=["link-to-user-file", "dangling-link", "fifo"])
@pytest.mark.parametrize("as_out", [False, True], ids=["default", "out"])
def test_probe_init_never_writes_through_what_it_did_not_create(tmp_path: Path, plant, force: bool,
                                                                 as_out: bool) -> None:
    code = code_tree(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "notes.txt"
    victim.write_text("the user's own words\n")
    planted = plant(code, victim, outside)
    kind = stat.S_IFMT(os.lstat(planted).st_mode)
    args = ["probe", "init", "--code", str(code), "--no-run", *(["--force"] if force else []),
            *(["--out", str(planted)] if as_out else [])]
    start = time.monotonic()
    done = sleuth(*args, cwd=tmp_path)
    assert time.monotonic() - start < DEADLINE_S
    line = one_line(done)
    assert "does not write through or replace it" in line
    assert victim.read_text() == "the user's own words\n"
    assert sorted(p.name for p in outside.iterdir()) == ["notes.txt"]
    assert stat.S_IFMT(os.lstat(planted).st_mode) == kind  # still what was planted: not replaced either


def test_probe_init_force_still_replaces_a_regular_file(tmp_path: Path) -> None:
    code = code_tree(tmp_path)
    (code / "probe_entry.py").write_text("# an older entry\n")
    done = sleuth("probe", "init", "--code", str(code), "--no-run", "--force", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    text = (code / "probe_entry.py").read_text()
    assert "def subject(" in text and "an older entry" not in text


# --- paths the user names -------------------------------------------------------------------------------

SPECIALS = {"fifo": lambda tmp: (os.mkfifo(tmp / "fifo"), tmp / "fifo")[1], "device": lambda tmp: Path("/dev/zero")}


@pytest.mark.parametrize("special", sorted(SPECIALS))
@pytest.mark.parametrize("command", [
    ["diagnose", "--offline", "--no-probe", "--code", "{p}"],
    ["diagnose", "--offline", "--no-probe", "--code", "{code}", "--config", "{p}"],
    ["probe", "init", "--no-run", "--code", "{p}"],
    ["probe", "init", "--no-run", "--code", "{code}", "--config", "{p}", "--out", "{tmp}/entry.py"],
    ["probe", "check", "--probe-entry", "entry:subject", "--code", "{p}"],
], ids=["diagnose-code", "diagnose-config", "init-code", "init-config", "check-code"])
def test_a_fifo_or_device_named_by_the_user_is_one_line(tmp_path: Path, special: str, command: list[str]) -> None:
    path = SPECIALS[special](tmp_path)
    code = code_tree(tmp_path)
    args = [a.format(p=path, code=code, tmp=tmp_path) for a in command]
    if args[0] == "diagnose":
        args += ["--out", str(tmp_path / "report")]
    line = one_line(sleuth(*args, cwd=tmp_path))
    assert f"is a {'FIFO' if special == 'fifo' else 'device'}" in line, line


# --- permission -----------------------------------------------------------------------------------------

def _as_unprivileged() -> list[str] | None:
    """The prefix that runs a command without root's power over file modes, or None where there is none."""
    if os.geteuid() != 0:
        return []
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    probe = subprocess.run([unshare, "--user", "true"], capture_output=True)
    return [unshare, "--user"] if probe.returncode == 0 else None


UNPRIVILEGED = _as_unprivileged()
needs_permissions = pytest.mark.skipif(UNPRIVILEGED is None, reason="root without user namespaces reads everything")


@needs_permissions
@pytest.mark.parametrize("what", ["run", "code-tree"])
def test_an_unreadable_run_or_code_tree_is_permission_denied(tmp_path: Path, what: str) -> None:
    target = write_run(tmp_path / "runs", "v1") if what == "run" else code_tree(tmp_path / "theirs")
    target.chmod(0)
    try:
        option = "--run" if what == "run" else "--code"
        done = sleuth("diagnose", option, str(target), "--offline", "--no-probe", "--out", str(tmp_path / "o"),
                      cwd=tmp_path, prefix=UNPRIVILEGED)
    finally:
        target.chmod(0o755)
    line = one_line(done)
    assert f"permission denied: {target}" in line, line


@needs_permissions
def test_an_unreadable_code_copy_and_checkpoint_are_permission_denied(tmp_path: Path) -> None:
    run = write_run(tmp_path / "runs", "v1")
    locked = [run / "code", run / "checkpoints" / "step-300"]
    for path in locked:
        path.chmod(0)
    try:
        done = sleuth("diagnose", "--run", str(run), "--offline", "--no-probe", "--format", "json",
                      "--out", str(tmp_path / "o"), cwd=tmp_path, prefix=UNPRIVILEGED)
    finally:
        for path in locked:
            path.chmod(0o755)
    assert done.returncode in (0, 1), done.stderr
    problems = json.loads((tmp_path / "o" / "report.json").read_text())["run"]["problems"]
    for path in locked:
        assert f"permission denied: {path}" in problems, problems
    assert not any("no checkpoints" in p or "no code/" in p for p in problems), problems


# --- deep JSON ------------------------------------------------------------------------------------------

DEEP = b'{"a":' * 100_000 + b"1" + b"}" * 100_000


@pytest.mark.parametrize("file", ["config.json", "run.json", "metrics.jsonl", "eval.json"])
def test_deep_json_in_a_run_is_one_line_naming_the_file(tmp_path: Path, file: str) -> None:
    run = write_run(tmp_path / "runs", "v1")
    (run / file).write_bytes(DEEP + b"\n")
    done = sleuth("diagnose", "--run", str(run), "--offline", "--no-probe", "--format", "json",
                  "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert "Traceback" not in done.stderr and "RecursionError" not in done.stderr + done.stdout
    assert done.returncode in (0, 1, 2), done.stderr
    said = done.stderr + (tmp_path / "o" / "report.json").read_text() if (tmp_path / "o" / "report.json").exists() \
        else done.stderr
    if file != "eval.json":  # optional: dropped, never a crash
        assert file in said and ("deeper than" in said or "garbled" in said), said[-2000:]


@pytest.mark.parametrize("command", [
    ["diagnose", "--offline", "--no-probe", "--code", "{code}", "--config", "{deep}", "--out", "{tmp}/o"],
    ["probe", "init", "--no-run", "--code", "{code}", "--config", "{deep}", "--out", "{tmp}/entry.py"],
    ["diagnose", "--offline", "--no-probe", "--code", "{code}", "--out", "{tmp}/o"],
], ids=["diagnose-config", "init-config", "beside-the-code"])
def test_deep_json_beside_foreign_code_is_bounded(tmp_path: Path, command: list[str]) -> None:
    code = code_tree(tmp_path / "theirs")
    deep = code / "config.json"
    deep.write_bytes(DEEP)
    done = sleuth(*[a.format(code=code, deep=deep, tmp=tmp_path) for a in command], cwd=tmp_path)
    assert "Traceback" not in done.stderr and "RecursionError" not in done.stderr + done.stdout
    if "--config" in command:
        line = one_line(done)
        assert "config.json" in line and "nests deeper than" in line, line
    else:
        assert done.returncode in (0, 1), done.stderr


# --- a huge metrics.jsonl -------------------------------------------------------------------------------

def test_a_metrics_file_of_blank_lines_is_streamed_in_bounded_time(tmp_path: Path) -> None:
    """64 MiB of newlines between two rows: read at the speed of the disk, not one Python step per line
    (main took ~40 s for this and minutes for the GBs the campaign used)."""
    run = write_run(tmp_path / "runs", "v1", rows=[])
    with (run / "metrics.jsonl").open("wb") as handle:
        handle.write(b'{"step": 10, "loss": 5.0}\n')
        block = b"\n" * (1 << 20)
        for _ in range(64):
            handle.write(block)
        handle.write(b'{"step": 20, "loss": 4.0}\n')
    start = time.monotonic()
    done = sleuth("diagnose", "--run", str(run), "--offline", "--no-probe", "--format", "json",
                  "--out", str(tmp_path / "o"), cwd=tmp_path)
    elapsed = time.monotonic() - start
    print(f"64 MiB of blank lines: diagnosed in {elapsed:.1f} s")
    assert done.returncode in (0, 1), done.stderr
    assert elapsed < 20
    outcome = json.loads((tmp_path / "o" / "report.json").read_text())
    assert "2 metrics rows" in json.dumps(outcome)
