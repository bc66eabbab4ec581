"""Shared parts of the trainer's fault suite: one REAL tiny run per test session, damaged copies of it, and
the assertions every fault must meet (one line on stderr, the right exit code, no traceback, nothing lost).

The base run is made once per process (functools.cache; under pytest-xdist once per worker) with the
embedded target's small recipe and the real training loop, then copied per case, so every damaged file
is a damaged version of a file the trainer really wrote.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# Tiny sizes for 2 CPU cores: two checkpoints (steps 2 and 4), a metrics row per step, no periodic eval.
TINY: dict[str, Any] = {
    "seq_len": 64, "batch_size": 2, "block_size": 4, "max_anchors": 4, "draft_layers": 2, "lr": 3e-3,
    "warmup_steps": 1, "log_every": 1, "eval_every": None, "checkpoint_every": 2, "steps": 4,
    "eval_prompts": 1, "eval_max_new_tokens": 2,
}
BASE_RUN = "base"
CHECKPOINT = "checkpoints/step-00000004"


@functools.cache
def session_dir() -> Path:
    root = Path(tempfile.mkdtemp(prefix="trainer-faults-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return root


@functools.cache
def small_target() -> Path:
    from trainer.target.embedded import build_embedded_target

    return build_embedded_target(session_dir() / "target", small=True, steps=1, progress=False)


def tiny_config(**changes: Any) -> dict[str, Any]:
    return {**TINY, "target": str(small_target()), **changes}


@functools.cache
def base_run() -> Path:
    """A real 4-step run, trained in this process: every fault case starts from a copy of it."""
    from trainer.config import build_config
    from trainer.run.loop import train
    from trainer.run.rundir import RunDir

    run = RunDir(session_dir() / "runs" / BASE_RUN)
    train(run, build_config(extra=tiny_config()), preset=None, device="cpu", progress=False)
    return run.path


def copy_base_run(runs_dir: Path, name: str = "r") -> Path:
    destination = runs_dir / name
    shutil.copytree(base_run(), destination, symlinks=True)
    return destination


# --- damage ------------------------------------------------------------------------------------------------
# Every run file the trainer reads, and every way the suite damages it.
RUN_FILES = (
    "config.json", "run.json", "metrics.jsonl", "fingerprint.json", "checkpoints/latest",
    f"{CHECKPOINT}/state.json", f"{CHECKPOINT}/drafter.safetensors", f"{CHECKPOINT}/optimizer.safetensors",
    f"{CHECKPOINT}/rng.safetensors",
)
DAMAGES = ("truncated", "empty", "wrong_type", "non_utf8", "symlinked_out")
# What a command rightly takes in its stride: `trainer runs` lists a run whose metrics lost rows (a torn
# last row is what a kill mid-append leaves; the readers drop it). A resume refuses both, because the
# checkpoint follows rows that are gone.
TOLERATED = {"runs": {("metrics.jsonl", "truncated"), ("metrics.jsonl", "empty")}}
# Which files each command reads: a damaged one must be reported; damage elsewhere must not matter.
READS = {
    "resume": set(RUN_FILES),
    # eval reads run.json too: the train-to-serve record and the chat rendering the prompts must match
    "eval": {"config.json", "run.json", "checkpoints/latest", f"{CHECKPOINT}/state.json",
             f"{CHECKPOINT}/drafter.safetensors"},
    "export": {"config.json", "run.json", "checkpoints/latest", f"{CHECKPOINT}/state.json",
               f"{CHECKPOINT}/drafter.safetensors"},
    "runs": {"config.json", "run.json", "metrics.jsonl"},
}


def damage(run_dir: Path, relative: str, how: str, outside: Path) -> None:
    """Damage one file of a run directory in place."""
    path = run_dir / relative
    data = path.read_bytes()
    if how == "truncated":
        cut = len(data) // 2
        while cut > 0 and data[cut - 1 : cut] == b"\n":  # cut inside a line, never on a line boundary
            cut -= 1
        path.write_bytes(data[:cut])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "wrong_type":
        path.write_bytes(_wrong_type(relative))
    elif how == "non_utf8":
        if relative.endswith(".safetensors"):  # the header's JSON with a byte that is not UTF-8
            path.write_bytes(data[:8] + b"\xff" + data[9:])
        else:
            path.write_bytes(b"\xff\xfe" + data[2:])
    elif how == "symlinked_out":
        outside.mkdir(parents=True, exist_ok=True)
        target = outside / relative.replace("/", "_")
        shutil.copyfile(path, target)
        path.unlink()
        path.symlink_to(target)
    else:
        raise ValueError(how)


def _wrong_type(relative: str) -> bytes:
    if relative.endswith(".safetensors"):
        return b'{"not": "a safetensors file"}'
    if relative.endswith("state.json"):
        return b'{"step": "4"}'  # a string step
    if relative.endswith("latest"):
        return b"../../elsewhere\n"
    if relative.endswith(".jsonl"):
        return b'["step", 1]\n["step", 2]\n'
    return b'["a", "list", "where", "an", "object", "belongs"]\n'


def damaged_cases() -> Iterator[tuple[str, str]]:
    for relative in RUN_FILES:
        for how in DAMAGES:
            yield relative, how


# --- running the commands ------------------------------------------------------------------------------------


def command_args(command: str, runs_dir: Path, out: Path, name: str = "r") -> list[str]:
    runs = ["--runs-dir", str(runs_dir)]
    return {
        "resume": ["run", name, "--resume", *runs, "--quiet"],
        "eval": ["eval", name, *runs, "--prompts", "1", "--max-new-tokens", "2", "--device", "cpu", "--json"],
        "export": ["export", name, *runs, "--out", str(out)],
        "runs": ["runs", *runs, "--json"],
    }[command]


def invoke(*args: str) -> Any:
    """The real CLI app in this process (fast); `result.stderr` is what the user sees on stderr."""
    from typer.testing import CliRunner

    from trainer.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "400", "TRAINER_DEBUG": ""})


def trainer_process(*args: str, **popen: Any) -> subprocess.Popen:
    """The CLI as a real process (for races, kills and a full disk)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    return subprocess.Popen([sys.executable, "-m", "trainer.cli", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def run_trainer(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    process = trainer_process(*args)
    stdout, stderr = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def snapshot(path: Path) -> dict[str, bytes | str]:
    """Every entry under path: bytes of files, the target of links, '<dir>' for folders."""
    entries: dict[str, bytes | str] = {}
    for entry in sorted(path.rglob("*")):
        key = str(entry.relative_to(path))
        if entry.is_symlink():
            entries[key] = f"-> {os.readlink(entry)}"
        elif entry.is_dir():
            entries[key] = "<dir>"
        else:
            entries[key] = entry.read_bytes()
    return entries


def no_traceback(output: str) -> None:
    assert "Traceback" not in output, output
    assert "internal error" not in output, output


def assert_one_line_error(stderr: str, exit_code: int, *, naming: str | None = None, code: int = 2) -> str:
    """The fault's contract: exit `code`, exactly one line on stderr (naming the file when given)."""
    no_traceback(stderr)
    lines = stderr.strip().splitlines()
    assert exit_code == code, f"exit {exit_code}: {stderr}"
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), lines[0]
    if naming is not None:
        assert naming in lines[0], lines[0]
    return lines[0]


def metric_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def debris(run_dir: Path) -> list[str]:
    """Temporary files a kill can leave between write and rename."""
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob(".*") if p.name.endswith((".tmp", ".partial")))

