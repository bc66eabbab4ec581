"""The run directory: the on-disk contract between `trainer` and `sleuth` (documented in README.md).

Everything here is written so that a run killed at any moment leaves a directory that either resumes
exactly or is diagnosable: JSON files are replaced atomically, metric rows are appended whole and
fsync'd, and a resume first drops any row logged after the checkpoint it restarts from.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import trainer

RUN_FORMAT_VERSION = 1
TRAINER_PACKAGE_DIR = Path(trainer.__file__).resolve().parent


class RunError(Exception):
    """A run directory problem a user can fix (exists already, missing, not a run)."""


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def now_iso() -> str:
    # Milliseconds: runs started a moment apart (the demo starts two at once) still order correctly.
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class RunDir:
    """One named run: `<runs-dir>/<name>/`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def name(self) -> str:
        return self.path.name

    config_path = property(lambda self: self.path / "config.json")
    run_info_path = property(lambda self: self.path / "run.json")
    metrics_path = property(lambda self: self.path / "metrics.jsonl")
    checkpoints_dir = property(lambda self: self.path / "checkpoints")
    eval_path = property(lambda self: self.path / "eval.json")
    diagnosis_dir = property(lambda self: self.path / "diagnosis")

    def exists(self) -> bool:
        return self.config_path.is_file()

    def read_config(self) -> dict[str, Any]:
        try:
            return json.loads(self.config_path.read_text())
        except FileNotFoundError:
            raise RunError(f"{self.path} is not a run directory (no config.json)") from None
        except json.JSONDecodeError as exc:
            raise RunError(f"{self.config_path} is corrupt: {exc.msg} at line {exc.lineno}") from None

    def read_info(self) -> dict[str, Any]:
        try:
            return json.loads(self.run_info_path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def write_info(self, info: dict[str, Any]) -> None:
        atomic_write_json(self.run_info_path, info)

    def update_info(self, **changes: Any) -> None:
        self.write_info({**self.read_info(), **changes})

    # --- metrics ------------------------------------------------------------------------------------------
    def append_metrics(self, row: dict[str, Any]) -> None:
        # One write() of a whole line, then fsync: a kill leaves at most one torn last line, which
        # truncate_metrics (on resume) and sleuth (tolerant reader) both drop.
        line = json.dumps(row) + "\n"
        with open(self.metrics_path, "a") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())

    def read_metrics(self) -> list[dict[str, Any]]:
        rows = []
        if not self.metrics_path.exists():
            return rows
        for line in self.metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a torn last line from a kill
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
        return rows

    def truncate_metrics(self, last_step: int) -> int:
        """Keep only whole rows with step <= last_step (the checkpoint we resume from); return kept count."""
        kept = [row for row in self.read_metrics() if row["step"] <= last_step]
        atomic_write_text(self.metrics_path, "".join(json.dumps(r) + "\n" for r in kept))
        return len(kept)

    # --- provenance ----------------------------------------------------------------------------------------
    def write_code_fingerprint(self, keep_existing: bool = False) -> dict[str, Any]:
        """sha256 of every trainer source file, and a copy of them: sleuth analyses what actually ran.

        A resumed run keeps the copy it started with (the code most of its steps ran); if the source
        changed since, run.json records the new fingerprint under `resumed_with_code`.
        """
        files: dict[str, str] = {}
        sources: dict[Path, bytes] = {}
        for source in sorted(TRAINER_PACKAGE_DIR.rglob("*.py")):
            relative = Path("trainer") / source.relative_to(TRAINER_PACKAGE_DIR)
            sources[relative] = source.read_bytes()
            files[relative.as_posix()] = hashlib.sha256(sources[relative]).hexdigest()
        code_root = self.path / "code"
        fingerprint_path = self.path / "fingerprint.json"
        if keep_existing and code_root.is_dir() and fingerprint_path.is_file():
            started = json.loads(fingerprint_path.read_text())
            if started.get("files") != files:
                self.update_info(resumed_with_code={"files": files, "git_commit": _git_commit(TRAINER_PACKAGE_DIR.parent)})
            return started
        # Staged and renamed: a kill mid-copy never leaves a partial code/ behind.
        staging = self.path / ".code.partial"
        if staging.exists():
            shutil.rmtree(staging)
        for relative, data in sources.items():
            destination = staging / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_bytes(data)
        if code_root.exists():
            shutil.rmtree(code_root)
        os.replace(staging, code_root)
        fingerprint = {
            "package_version": trainer.__version__,
            "git_commit": _git_commit(TRAINER_PACKAGE_DIR.parent),
            "git_dirty": _git_dirty(TRAINER_PACKAGE_DIR.parent),
            "files": files,
        }
        atomic_write_json(self.path / "fingerprint.json", fingerprint)
        return fingerprint

    def write_environment(self, device: str) -> None:
        import torch
        import transformers

        atomic_write_json(
            self.path / "env.json",
            {
                "python": sys.version.split()[0],
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "device": device,
                "cuda_device": torch.cuda.get_device_name(0) if device.startswith("cuda") else None,
                "platform": platform.platform(),
                "cpu_threads": torch.get_num_threads(),
            },
        )


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _git_commit(repo: Path) -> str | None:
    return _git(repo, "rev-parse", "HEAD") or None


def _git_dirty(repo: Path) -> bool | None:
    status = _git(repo, "status", "--porcelain", "--", "trainer")
    return None if status is None else bool(status)


def list_runs(runs_dir: Path) -> list[RunDir]:
    if not runs_dir.is_dir():
        return []
    return sorted(
        (RunDir(p) for p in runs_dir.iterdir() if (p / "config.json").is_file()),
        key=lambda run: run.read_info().get("created", ""),
    )


def next_version_name(runs_dir: Path) -> str:
    """The next free `vN` after the highest existing one (v3, v5, v6 -> v7)."""
    numbers = [int(m.group(1)) for p in runs_dir.glob("v*") if (m := re.fullmatch(r"v(\d+)", p.name))]
    return f"v{max(numbers, default=0) + 1}"
