"""The run directory: the on-disk contract between `trainer` and `sleuth` (documented in docs/reference/run-directory.md).

Everything here is written so that a run killed at any moment leaves a directory that either resumes
exactly or is diagnosable: JSON files are replaced atomically, metric rows are appended whole and
fsync'd, and a resume first drops any row logged after the checkpoint it restarts from.

Every run file is read through one validated reader (read_json_object, RunDir.read_metrics, and the
checkpoint readers in checkpoint.py) shared by resume, eval, export and `trainer runs`: a damaged file
(truncated, empty, the wrong JSON type, not UTF-8, a link out of the run) is one RunError naming it.
A run's name is claimed under a lock (RunLock) before anything is written, and a new run only ever goes
where nothing is, or into an empty directory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
from datetime import datetime, timezone
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trainer
from trainer import safe_io
from trainer.run.trust import record_trusted_code

RUN_FORMAT_VERSION = 1
TRAINER_PACKAGE_DIR = Path(trainer.__file__).resolve().parent


class RunError(Exception):
    """A run directory problem a user can fix (exists already, missing, not a run, a damaged file)."""


class RunInUse(RunError):
    """Another trainer process holds the run: the loser of a race exits without touching anything."""


# Files and folders the trainer writes into a run directory; anything else in it belongs to the user.
RUN_ENTRIES = frozenset(
    {"config.json", "run.json", "metrics.jsonl", "eval.json", "env.json", "fingerprint.json", "code",
     "checkpoints", "diagnosis", "draft_vocab.safetensors", "tensorboard"}
)
# A run record is a few kB; a larger one is not ours, and reading it whole would only cost memory.
MAX_RECORD_BYTES = 16 * 2**20
# What a kill between "write the temporary file" and "rename it into place" leaves behind.
_DEBRIS = re.compile(r"\.(config\.json|run\.json|metrics\.jsonl|eval\.json|env\.json|fingerprint\.json|"
                     r"draft_vocab\.safetensors)\..+\.tmp|\.code\.partial")


def atomic_write_text(path: Path, text: str) -> None:
    # trainer.safe_io: a temporary file of our own, fsync'd and renamed; a link or special file refused
    safe_io.write_text(path, text)


def atomic_write_json(path: Path, data: Any) -> None:
    safe_io.write_json(path, data, indent=2)


def now_iso() -> str:
    # Milliseconds: runs started a moment apart (the demo starts two at once) still order correctly.
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


# --- the one reader of every run file ---------------------------------------------------------------------


def present(path: Path) -> bool:
    """Whether an entry is at `path` (a link counts, dangling or not). A directory on the way that this user
    cannot search is `permission denied: DIR`, never "missing" or "not a run directory"."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except PermissionError:
        raise RunError(f"permission denied: {path.parent}") from None
    return True


def check_inside(path: Path, root: Path) -> None:
    """Refuse a run file that is a link leading outside its run directory: reading it would report on
    someone else's file, and writing through it would change a file that is not the run's."""
    if not present(path):
        return
    resolved, base = path.resolve(), root.resolve()
    if resolved != base and base not in resolved.parents:
        raise RunError(f"{path} links to {resolved}, outside the run directory; refusing to use it")


def read_bytes(path: Path, root: Path, limit: int = MAX_RECORD_BYTES) -> bytes:
    check_inside(path, root)
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode) and not stat.S_ISDIR(info.st_mode):
            # A FIFO would block the read forever, a device never end: neither is a run file.
            raise RunError(f"{path} is not a regular file; refusing to read it")
        size = info.st_size
        if size > limit:
            raise RunError(f"{path} is {size} bytes, more than any run file holds ({limit}); refusing to read it")
        return path.read_bytes()
    except FileNotFoundError:
        raise RunError(f"{path} is missing") from None
    except IsADirectoryError:
        raise RunError(f"{path} is a directory, not a file") from None
    except OSError as exc:
        raise RunError(_cannot_read(path, exc)) from None


def read_text(path: Path, root: Path, limit: int = MAX_RECORD_BYTES) -> str:
    data = read_bytes(path, root, limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RunError(f"{path} is not UTF-8 text (bad byte at offset {exc.start}); the file is damaged") from None


def read_json(path: Path, root: Path) -> Any:
    text = read_text(path, root)
    if not text.strip():
        raise RunError(f"{path} is empty; the file is damaged")
    try:
        return safe_io.loads_json(text)
    except json.JSONDecodeError as exc:
        raise RunError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); it may be truncated") from None
    except safe_io.JsonTooDeep:
        raise RunError(f"{path} nests too deeply to be a run file") from None
    except ValueError as exc:  # a number of more digits than Python converts
        raise RunError(f"{path} is not a run file ({' '.join(str(exc).split())[:120]})") from None


def read_json_object(path: Path, root: Path) -> dict[str, Any]:
    data = read_json(path, root)
    if not isinstance(data, dict):
        raise RunError(f"{path} holds a JSON {_json_type(data)} where an object is expected; the file is damaged")
    return data


def _json_type(value: Any) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")


def is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class RunDir:
    """One named run: `<runs-dir>/<name>/`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.header_written = False  # set by the training loop once this process wrote the run's record

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

    def has_record(self) -> bool:
        """config.json or run.json is there (damaged or not): the directory is, or was, a run."""
        return present(self.config_path) or present(self.run_info_path)

    def read_config(self) -> dict[str, Any]:
        if not present(self.config_path):
            raise RunError(f"{self.path} is not a run directory (no config.json)")
        return read_json_object(self.config_path, self.path)

    def load_config(self) -> Any:
        """The run's config.json as a validated TrainConfig; a file that does not validate is named."""
        from trainer.config import ConfigError, validate_config

        try:
            return validate_config(self.read_config())
        except ConfigError as exc:
            raise RunError(f"{self.config_path} is not a valid run config ({exc})") from None

    def read_info(self) -> dict[str, Any]:
        """run.json, strictly: a damaged record is an error, never silently replaced by an empty one."""
        if not present(self.run_info_path):
            return {}
        return read_json_object(self.run_info_path, self.path)

    def write_info(self, info: dict[str, Any]) -> None:
        check_inside(self.run_info_path, self.path)
        atomic_write_json(self.run_info_path, info)

    def update_info(self, **changes: Any) -> None:
        self.write_info({**self.read_info(), **changes})

    # --- metrics ------------------------------------------------------------------------------------------
    def append_metrics(self, row: dict[str, Any]) -> None:
        # One write() of a whole line, then fsync: a kill leaves at most one torn last line, which
        # truncate_metrics (on resume) and sleuth (tolerant reader) both drop. O_NOFOLLOW: never append
        # through a link to somebody else's file.
        line = (json.dumps(row) + "\n").encode()
        # O_NONBLOCK: a FIFO planted under the name fails to open instead of blocking; fstat refuses any other
        # special file (a regular file ignores the flag).
        fd = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise RunError(f"{self.metrics_path} is not a regular file; refusing to write to it")
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def iter_metric_lines(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """(end offset, row) of every whole row, streamed: the file is read in chunks, never whole, and
        blank lines (any number of them) are skipped at C speed, so memory stays bounded by the longest row
        whatever the file's size. A torn last line (a kill mid-write) is dropped; any other line that is not
        a metrics row, or one longer than a row can be, is an error naming the file and the line."""
        path = self.metrics_path
        if not present(path):
            return
        check_inside(path, self.path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            raise RunError(f"{path} is missing") from None
        except OSError as exc:
            raise RunError(_cannot_read(path, exc)) from None
        with os.fdopen(fd, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                # A FIFO would block the read forever, a device never end: neither is a run file.
                raise RunError(f"{path} is not a regular file; refusing to read it")
            pending = b""  # the start of a line whose newline has not been read yet
            offset = 0  # file offset of pending[0]
            line = 1  # line number of pending[0]
            while True:
                try:
                    chunk = handle.read(_METRICS_CHUNK)
                except OSError as exc:
                    raise RunError(_cannot_read(path, exc)) from None
                if not chunk:
                    break
                if not pending and not chunk.strip():  # a chunk of blank lines: count them, keep nothing
                    line += chunk.count(b"\n")
                    offset += len(chunk)
                    continue
                pending += chunk
                last_newline = pending.rfind(b"\n")
                if last_newline < 0 and not pending.strip():  # blank so far: nothing to keep
                    offset += len(pending)
                    pending = b""
                    continue
                if last_newline < 0:
                    if len(pending) > MAX_METRICS_LINE:
                        raise RunError(f"{path} line {line} is longer than {MAX_METRICS_LINE} bytes, not a metrics "
                                       "row; the file is damaged")
                    continue
                whole, pending = pending[: last_newline + 1], pending[last_newline + 1 :]
                for end, number, raw in _content_lines(whole, offset, line):
                    row = _metrics_row(raw)
                    if row is None:
                        raise RunError(f"{path} line {number} is not a metrics row (a JSON object with an integer "
                                       "step); the file is damaged")
                    yield end, row
                line += whole.count(b"\n")
                offset += len(whole)
            if pending.strip():  # no newline after it: written by a process that was killed
                row = _metrics_row(pending)
                if row is not None:
                    yield offset + len(pending), row

    def _metric_lines(self) -> list[tuple[int, dict[str, Any]]]:
        return list(self.iter_metric_lines())

    def iter_metrics(self) -> Iterator[dict[str, Any]]:
        for _, row in self.iter_metric_lines():
            yield row

    def read_metrics(self) -> list[dict[str, Any]]:
        return list(self.iter_metrics())

    def truncate_metrics(self, last_step: int) -> int:
        """Keep only whole rows with step <= last_step (the checkpoint we resume from); return kept count.

        Rows are appended in step order, so the kept rows are a prefix: the file is cut in place (one
        syscall, no temporary file for a kill to leave behind). Out-of-order rows fall back to a rewrite.
        """
        lines = self._metric_lines()
        kept = [entry for entry in lines if entry[1]["step"] <= last_step]
        if kept == lines[: len(kept)]:
            cut = kept[-1][0] if kept else 0
            if os.path.lexists(self.metrics_path):
                check_inside(self.metrics_path, self.path)
                if self.metrics_path.stat().st_size != cut:
                    fd = os.open(self.metrics_path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
                    try:
                        os.ftruncate(fd, cut)
                        os.fsync(fd)
                    finally:
                        os.close(fd)
        else:
            atomic_write_text(self.metrics_path, "".join(json.dumps(row) + "\n" for _, row in kept))
        return len(kept)

    # --- claiming -----------------------------------------------------------------------------------------
    def lock_path(self) -> Path:
        # Next to the run, not in it: claiming a name never writes into a directory that may be a user's.
        return self.path.parent / f".{self.name}.lock"

    def check_new(self) -> None:
        """A new run goes only where nothing is, or into an empty directory: never over a run (even a
        damaged one) and never into somebody's folder."""
        if not os.path.lexists(self.path):
            return
        if not self.path.is_dir():
            raise RunError(f"{self.path} exists and is not a directory; pick another run name")
        entries = sorted(p.name for p in self.path.iterdir())
        if not entries:
            return
        if self.has_record():
            try:
                self.read_config()
                self.read_info()
            except RunError as exc:
                raise RunError(f"run {self.name!r} in {self.path.parent} is damaged ({exc}); refusing to "
                               "overwrite it: move it away or pick another name") from None
            raise RunError(f"run {self.name!r} already exists in {self.path.parent}; use --resume or another name")
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise RunError(f"{self.path} exists and is not a trainer run (it holds {shown}); refusing to write "
                       "into it: pick another run name")

    def check_resumable(self) -> None:
        if not self.path.is_dir() or not self.has_record():
            raise RunError(f"nothing to resume: {self.path} holds no run")
        if not os.path.lexists(self.config_path):
            raise RunError(f"run {self.name!r} lost its config.json ({self.config_path}); it cannot be resumed")
        for entry in (*self.path.iterdir(), *(self.checkpoints_dir.iterdir() if self.checkpoints_dir.is_dir() else ())):
            check_inside(entry, self.path)
        self.read_info()

    def sweep_debris(self) -> list[str]:
        """Remove what a kill left between writing a temporary file and renaming it: only names the
        trainer itself uses for staging, never anything else in the directory."""
        removed = []
        for parent, pattern in ((self.path, _DEBRIS), (self.checkpoints_dir, _CHECKPOINT_DEBRIS)):
            if not parent.is_dir():
                continue
            for entry in parent.iterdir():
                if pattern.fullmatch(entry.name) and not entry.is_symlink():
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                    removed.append(str(entry.relative_to(self.path)))
        return removed

    def read_fingerprint(self) -> dict[str, Any] | None:
        path = self.path / "fingerprint.json"
        return read_json_object(path, self.path) if present(path) else None

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
            started = self.read_fingerprint() or {}
            if started.get("files") != files:
                self.update_info(resumed_with_code={"files": files, "git_commit": _git_commit(TRAINER_PACKAGE_DIR.parent)})
            return started
        # Staged and renamed: a kill mid-copy never leaves a partial code/ behind.
        staging = self.path / ".code.partial"
        _remove_own_entry(staging)
        self.path.mkdir(parents=True, exist_ok=True)  # the run directory itself, as the copy always made it
        staging.mkdir()  # fresh, made by this process: what is written inside cannot meet a planted link
        for relative, data in sources.items():
            destination = staging / relative
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_bytes(data)
        _remove_own_entry(code_root)
        os.replace(staging, code_root)
        fingerprint = {
            "package_version": trainer.__version__,
            "git_commit": _git_commit(TRAINER_PACKAGE_DIR.parent),
            "git_dirty": _git_dirty(TRAINER_PACKAGE_DIR.parent),
            "files": files,
        }
        atomic_write_json(self.path / "fingerprint.json", fingerprint)
        # This user's own trainer wrote this code/ tree: sleuth may probe it without --probe (docs/security.md).
        record_trusted_code(files, self.path, f"trainer {trainer.__version__}")
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


def _remove_own_entry(path: Path) -> None:
    """Remove an entry the trainer put in the run (code/, its staging copy) before writing it anew; a link
    there is removed as a link, never followed into the folder it names."""
    if path.is_symlink() or (os.path.lexists(path) and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


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
    """Every directory under runs_dir that is, or was, a run (damaged ones included), by name."""
    if not runs_dir.is_dir():
        return []
    return sorted((RunDir(p) for p in runs_dir.iterdir() if p.is_dir() and _maybe_run(RunDir(p))),
                  key=lambda run: run.name)


def _maybe_run(run: RunDir) -> bool:
    """A run, or a directory this user cannot look into: listed, so its reader says `permission denied`
    instead of the run silently missing from the list."""
    try:
        return run.has_record()
    except RunError:
        return True


def next_version_name(runs_dir: Path) -> str:
    """The next free `vN` after the highest existing one (v3, v5, v6 -> v7)."""
    numbers = [int(m.group(1)) for p in runs_dir.glob("v*") if (m := re.fullmatch(r"v(\d+)", p.name))]
    return f"v{max(numbers, default=0) + 1}"


def resolve_run(run: str | Path, runs_dir: Path) -> RunDir:
    """A run name under runs_dir, or the path of a run directory: the one resolver every command uses."""
    named = Path(runs_dir) / str(run)
    for candidate in (named, Path(run)):
        if candidate.is_dir() and RunDir(candidate).has_record():  # has_record: `permission denied` if unsearchable
            return RunDir(candidate)
    for candidate in (named, Path(run)):
        if candidate.is_dir():
            raise RunError(f"{candidate} is not a run directory (no config.json)")
    raise RunError(f"no run named {str(run)!r} in {runs_dir} (list them with `trainer runs`)")


# Metrics are read in chunks of this size; a row is a few hundred bytes, so a longer line is not one.
_METRICS_CHUNK = 1 << 20
MAX_METRICS_LINE = 1 << 20
_NOT_SPACE = re.compile(rb"\S")


def _content_lines(block: bytes, offset: int, line: int) -> Iterator[tuple[int, int, bytes]]:
    """(end offset, line number, bytes) of each line of `block` (whole lines) that is not blank; runs of
    blank lines are skipped by one regex search each."""
    position = 0
    while (found := _NOT_SPACE.search(block, position)) is not None:
        start = block.rfind(b"\n", 0, found.start()) + 1
        end = block.index(b"\n", found.start())
        line += block.count(b"\n", position, start)
        yield offset + end + 1, line, block[start:end]
        line += 1
        position = end + 1


def _cannot_read(path: Path, exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied: {path}"
    return f"cannot read {path}: {exc.strerror or exc}"


def _metrics_row(raw: bytes) -> dict[str, Any] | None:
    try:
        row = safe_io.loads_json(raw.decode("utf-8"))
    except ValueError:  # not UTF-8, not JSON, nested too deeply, a number too long to convert
        return None
    return row if isinstance(row, dict) and is_step(row.get("step")) else None


_CHECKPOINT_DEBRIS = re.compile(r"\.step-\d+\.partial|\.latest\..+\.tmp")


class RunLock:
    """The claim on a run name: an exclusive lock on `<runs-dir>/.<name>.lock` held for the whole command.

    flock rather than a bare create-exclusive file: the kernel drops the lock when its process dies, so a
    run killed with SIGKILL never leaves a stale claim that would need guessing about dead pids. After
    locking, the file must still be the one at the path (a releasing holder unlinks it), so two processes
    can never both believe they hold the name.
    """

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.path = run.lock_path()
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 64).decode(errors="replace").strip()
                os.close(fd)
                raise RunInUse(
                    f"run {self.run.name!r} in {self.run.path.parent} is in use by another trainer process"
                    f"{f' (pid {holder})' if holder.isdigit() else ''}; wait for it or pick another name"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder released and unlinked it between our open and lock: try again
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # unlink while still holding it: see acquire()
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim_run(run: RunDir, *, resume: bool) -> RunLock:
    """Lock the run's name, then check the directory under the lock: a new run only where nothing (or an
    empty directory) is, a resume only of a run; debris of an earlier kill is swept. The caller releases."""
    lock = RunLock(run)
    lock.acquire()
    try:
        if resume:
            run.check_resumable()
            run.sweep_debris()
        else:
            run.check_new()
    except BaseException:
        lock.release()
        raise
    return lock


def claim_next_version(runs_dir: Path, attempts: int = 100) -> tuple[RunDir, RunLock]:
    """`--fixed`'s `vN`: the next free number, claimed; a process that loses the race takes the next one."""
    first = int(next_version_name(runs_dir)[1:])
    for number in range(first, first + attempts):
        run = RunDir(runs_dir / f"v{number}")
        try:
            return run, claim_run(run, resume=False)
        except RunError:  # held by another process, or created meanwhile: the next number
            continue
    raise RunError(f"could not claim a free vN run name in {runs_dir} after {attempts} tries")


def run_is_active(run: RunDir) -> bool:
    """Whether a live process holds the run's lock (on this machine)."""
    try:
        holder = run.lock_path().read_text(errors="replace").strip()
    except OSError:
        return False
    if not holder.isdigit():
        return False
    try:
        os.kill(int(holder), 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True
