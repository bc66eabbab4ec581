"""Which code sleuth runs without being asked: the trust record of code/ trees the user's own trainer wrote.

`sleuth diagnose --run DIR` probes a run's `code/` copy by default only when that exact tree was written by
the user's own `trainer run` on this machine: the run directory alone proves nothing (anyone can copy,
edit or forge one), so the proof lives outside it, in a user-local directory only the user can write.

The record (a documented contract: `trainer` writes it, `sleuth` reads it, neither imports the other):
  * directory: $SLEUTH_TRUST_DIR, else platformdirs `user_data_dir("sleuth")/trusted-code`; created 0700,
    and ignored (nothing trusted) when it is not owned by the user or is writable by group or others;
  * one file per trusted tree, `<tree sha256>.json`, a JSON object with at least
    `{"format": 1, "tree_sha256": "<the same hex>"}` (the trainer adds `recorded_by`, `run`, `created`);
  * the tree hash: sha256 of the lines `<sha256 of the file's bytes>  <path relative to code/>\\n`, one per
    file, sorted by path (paths with `/`, UTF-8): what `sha256sum` prints for the files, sorted.

sleuth hashes the copy it is about to run (copy first, hash the copy, run the copy), never the run
directory, so nothing can change between the check and the run.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TRUST_DIR_ENV = "SLEUTH_TRUST_DIR"
TRUST_FORMAT = 1
# A record is a few hundred bytes; anything larger is not one.
_MAX_RECORD_BYTES = 64 * 1024


def trust_dir() -> Path:
    configured = os.environ.get(TRUST_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("sleuth")) / "trusted-code"


def tree_sha256(files: Mapping[str, str]) -> str:
    """The tree hash of `{relative posix path: sha256 hex of the file's bytes}` (see the module docstring)."""
    lines = "".join(f"{digest}  {path}\n" for path, digest in sorted(files.items()))
    return hashlib.sha256(lines.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass(frozen=True)
class TrustCheck:
    trusted: bool
    tree_sha256: str
    reason: str  # what was found, for the report: "recorded by trainer 0.1.0 (run ...)", or why not


def check_trust(tree: str, directory: Path | None = None) -> TrustCheck:
    """Is `tree` (a tree hash) in the user's trust record?"""
    directory = directory if directory is not None else trust_dir()
    short = f"sha256:{tree[:16]}"
    problem = _unsafe_directory(directory)
    if problem is not None:
        return TrustCheck(False, tree, f"no trust record for {short}: {problem}")
    record_path = directory / f"{tree}.json"
    record = _read_record(record_path)
    if record is None or record.get("tree_sha256") != tree or record.get("format") != TRUST_FORMAT:
        return TrustCheck(False, tree, f"no trust record for {short} in {directory} (this code/ was not written "
                          "by your trainer on this machine)")
    by = record.get("recorded_by") if isinstance(record.get("recorded_by"), str) else "the trainer"
    run = f" for run {record['run']}" if isinstance(record.get("run"), str) else ""
    return TrustCheck(True, tree, f"{short} recorded by {by}{run} in {directory}")


def _unsafe_directory(directory: Path) -> str | None:
    try:
        info = os.lstat(directory)
    except OSError:
        return f"{directory} does not exist"
    if not stat.S_ISDIR(info.st_mode):
        return f"{directory} is not a directory"
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        return f"{directory} is not owned by you"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{directory} is writable by others, so it proves nothing"
    return None


def _read_record(path: Path) -> dict | None:
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_RECORD_BYTES:
            return None
        if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
            return None
        data = os.read(fd, _MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)
    try:
        record = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) else None


__all__ = ["TRUST_DIR_ENV", "TRUST_FORMAT", "TrustCheck", "check_trust", "tree_sha256", "trust_dir"]
