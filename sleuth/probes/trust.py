"""Which code sleuth runs without being asked: the trust record of code/ trees the user's own trainer wrote.

`sleuth diagnose --run DIR` probes a run's `code/` copy by default only when the user's own `trainer run`
on this machine wrote that exact tree *into that run directory*: the run directory alone proves nothing
(anyone can copy, edit or forge one), so the proof lives outside it, in a user-local directory only the
user can write; and the same tree in another run directory (a colleague's run of the same trainer version,
with a run.json of their own that steers the code) is not the user's run.

The record (a documented contract: `trainer` writes it, `sleuth` reads it, neither imports the other):
  * directory: $SLEUTH_TRUST_DIR, else platformdirs `user_data_dir("sleuth")/trusted-code`; created 0700,
    and ignored (nothing trusted) when it is not owned by the user or is writable by group or others;
  * format 2 (written now): one file per (tree, run), `<record_key(tree, run)>.json`, a JSON object
    `{"format": 2, "tree_sha256": "<tree hash>", "run": "<the run directory, resolved>", ...}` (the
    trainer adds `recorded_by`, `files`, `created`). The tree hash: sha256 over `sleuth-tree-2\\0`, then per
    file sorted by path: the UTF-8 path's length (8 bytes, big-endian), the path (`/`-separated, relative
    to code/), the file's sha256 (32 bytes). Length-prefixed: no path, newline or not, can pose as two.
  * format 1 (older trainers): `<v1 hash>.json`, the v1 hash being sha256 of the lines
    `<file sha256>  <path>\\n` sorted by path. Still read, but only for the run it names (its `run`
    field, the resolved run directory), and only for trees without control characters in a path (sleuth
    never copies those), where lines cannot run together. Re-running the trainer writes format 2.

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
TRUST_FORMAT = 2
LEGACY_FORMAT = 1
# A record is a few hundred bytes; anything larger is not one.
_MAX_RECORD_BYTES = 64 * 1024


def trust_dir() -> Path:
    configured = os.environ.get(TRUST_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("sleuth")) / "trusted-code"


def tree_sha256(files: Mapping[str, str]) -> str:
    """The format-2 tree hash of `{relative posix path: sha256 hex of the file's bytes}` (module docstring)."""
    digest = hashlib.sha256(b"sleuth-tree-2\0")
    for path, file_digest in sorted(files.items()):
        name = path.encode("utf-8", "surrogateescape")
        digest.update(len(name).to_bytes(8, "big") + name + bytes.fromhex(file_digest))
    return digest.hexdigest()


def legacy_tree_sha256(files: Mapping[str, str]) -> str:
    """The format-1 tree hash (sorted `sha256sum` lines), for records older trainers wrote."""
    lines = "".join(f"{digest}  {path}\n" for path, digest in sorted(files.items()))
    return hashlib.sha256(lines.encode("utf-8", "surrogateescape")).hexdigest()


def record_key(tree: str, run: str) -> str:
    """The record's file name (without .json) for a tree in a run: one record per run, so that two runs of
    the same code are recorded side by side."""
    return hashlib.sha256(f"{tree}\0{run}".encode("utf-8", "surrogateescape")).hexdigest()


def run_key(run_dir: Path) -> str:
    """How a record names its run: the resolved path of the run directory."""
    return str(Path(os.path.realpath(run_dir)))


@dataclass(frozen=True)
class TrustCheck:
    trusted: bool
    tree_sha256: str
    reason: str  # what was found, for the report: "recorded by trainer 0.1.0 (run ...)", or why not


def check_trust(files: Mapping[str, str], run_dir: Path, directory: Path | None = None) -> TrustCheck:
    """Did the user's trainer record the tree `files` ({path: sha256}, the copy sleuth will run) for `run_dir`?"""
    directory = directory if directory is not None else trust_dir()
    tree = tree_sha256(files)
    short = f"sha256:{tree[:16]}"
    problem = _unsafe_directory(directory)
    if problem is not None:
        return TrustCheck(False, tree, f"no trust record for {short}: {problem}")
    run = run_key(run_dir)
    record = _read_record(directory / f"{record_key(tree, run)}.json")
    if record is not None and record.get("format") == TRUST_FORMAT and record.get("tree_sha256") == tree \
            and record.get("run") == run:
        return TrustCheck(True, tree, f"{short} recorded by {_by(record)} for run {run} in {directory}")
    if not any(_has_control(path) for path in files):
        legacy = legacy_tree_sha256(files)
        record = _read_record(directory / f"{legacy}.json")
        if record is not None and record.get("format") == LEGACY_FORMAT and record.get("tree_sha256") == legacy:
            if record.get("run") == run:
                return TrustCheck(True, tree, f"{short} recorded (format 1) by {_by(record)} for run {run} in "
                                  f"{directory}")
            return TrustCheck(False, tree, f"no trust record for {short} in this run: your trainer recorded the "
                              f"same code for another run ({record.get('run')!s:.200}), and a run's own files "
                              "steer its code")
    return TrustCheck(False, tree, f"no trust record for {short} and run {run} in {directory} (your trainer did "
                      "not write this code/ into this run directory on this machine)")


def _by(record: dict) -> str:
    by = record.get("recorded_by")
    return by[:100] if isinstance(by, str) else "the trainer"


def _has_control(path: str) -> bool:
    return any(ord(ch) < 0x20 or ord(ch) == 0x7F for ch in path)


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


__all__ = ["LEGACY_FORMAT", "TRUST_DIR_ENV", "TRUST_FORMAT", "TrustCheck", "check_trust", "legacy_tree_sha256",
           "record_key", "run_key", "tree_sha256", "trust_dir"]
