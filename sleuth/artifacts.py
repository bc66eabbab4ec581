"""Files sleuth did not write, read one way; files sleuth writes, written one way.

A run directory can come from anywhere: a colleague's share, a download, another trainer (speculators,
SpecForge), a checkpoint, a tensorboard folder. Every file of it is read through this module, under one
discipline, so that no damaged or hostile file can hang, exhaust or crash a diagnosis:

- **Regular files only.** A FIFO, a device, a socket or a directory where a file belongs is refused. Files
  are opened with O_NONBLOCK (a FIFO with no writer would otherwise block the open forever) and checked
  with fstat before one byte is read.
- **No link leaving its directory.** A file read as part of a run (`within=` the run's directory) that is a
  link resolving outside it (to ~/.ssh/id_rsa, /dev/zero) is refused. Links inside it (speculators'
  `checkpoint_best -> 3`) are followed.
- **Bounded.** Every read has a size cap; JSON also a nesting depth and a number-length cap (a 5000-digit
  integer takes seconds to convert and a 400-digit one overflows `float()` wherever it meets one).
- **Names are bytes.** A file or directory name that is not UTF-8 reaches Python as lone surrogates, which
  every UTF-8 sink refuses (UnicodeEncodeError). `shown()` renders a name for a message, with `\\xNN` for
  such bytes and escapes for control characters; `printable()` does the surrogate part for whole texts at
  the sinks (report files, trace, terminal, chart labels).
- **Every field type-checked.** `check_shape` walks a parsed document against the types its readers rely
  on (an object where `.get` follows, a list where it is iterated) and drops each field of the wrong type
  with one line naming the file and the field, so no reader meets a list where an object belongs.
- **One line.** Anything wrong is an `ArtifactError` whose message names the file and says what is wrong.

Writes (report.md/json/sarif, fix.yaml, trace.jsonl, chart.png) go through `write_atomic`: the directory is
opened without following a link, the bytes go to a fresh temporary name created with O_CREAT | O_EXCL |
O_NOFOLLOW inside it, and that file is renamed over the final name. A link or FIFO planted at the final
name or at any temporary name is replaced or refused, never followed or written through.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# run.json, config.json, training_state.json, val_metrics.json, a verifier's config: a few KiB each.
MAX_JSON_BYTES = 16 * 1024 * 1024
# Deeper than any config or state file is written (a multimodal HF config nests 3-4 levels); shallow
# enough that no recursive reader downstream (flatten, json.dumps, pydantic) meets Python's recursion limit.
MAX_JSON_DEPTH = 64
# int64 has 19 digits, a float's repr at most 24 characters; a literal past 64 (a 400-digit integer overflows
# float(), a 5000-digit one takes seconds to convert) is damage, not a value.
MAX_NUMBER_CHARS = 64
# A text file that is a record or an argv (train_command.txt, checkpoints/latest): its head is all there is.
MAX_RECORD_BYTES = 1024 * 1024

_SURROGATE = re.compile("[\ud800-\udfff]")


class ArtifactError(ValueError):
    """A file that cannot be read as what it should be; the message is one line that names it."""

    def __init__(self, path: Path | str, reason: str) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"{shown(path)} {reason}")


# --- names -------------------------------------------------------------------------------------------------


def printable(text: str) -> str:
    """`text` with lone surrogates (a non-UTF-8 name's bytes, or a JSON `\\ud800` escape) spelled out:
    `\\xff` for a byte a non-UTF-8 file name held, `\\ud800` for any other. Every UTF-8 sink accepts it."""
    if not _SURROGATE.search(text):
        return text

    def spell(match: re.Match[str]) -> str:
        code = ord(match.group(0))
        return f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"

    return _SURROGATE.sub(spell, text)


def printable_data(value: Any) -> Any:
    """Every string inside a JSON-like value made printable (keys too)."""
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable_data(k): printable_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [printable_data(v) for v in value]
    return value


def shown(name: Path | str | bytes) -> str:
    """A path or name for a one-line message: printable, control characters (a newline, an escape
    sequence in a file name) escaped, so a name can neither break the line nor drive the terminal."""
    from sleuth.escape import escape_unsafe  # the terminal's escaping (bidi, invisible characters too)

    return escape_unsafe(os.fsdecode(name) if isinstance(name, bytes) else str(name))


# --- opening ----------------------------------------------------------------------------------------------


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def is_within(path: Path, root: Path) -> bool:
    """Whether `path`, every link resolved, lies inside `root` (resolved too)."""
    try:
        real, base = os.path.realpath(path), os.path.realpath(root)
    except (OSError, ValueError):
        return False
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def regular_file(path: Path, *, within: Path | None = None) -> bool:
    """True for a readable regular file; False when nothing is there (or a link leads nowhere).
    ArtifactError for something that is there but must not be read: a FIFO, a device, a directory, a link
    leaving `within`. Never opens the file."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return False
    except (OSError, ValueError) as exc:
        raise ArtifactError(path, f"cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    if within is not None and not is_within(path, within):
        # The file, or a folder on its way, is a link that leads out of the directory it belongs to.
        raise ArtifactError(path, f"is a link leading outside {shown(within)}; not followed")
    if not stat.S_ISREG(info.st_mode):
        raise ArtifactError(path, f"is {_kind(info.st_mode)}, not a regular file")
    return True


def named_path_problem(path: Path, *, directory_ok: bool = True, file_ok: bool = True) -> str | None:
    """What is wrong with a path the user named, in one phrase to follow the option and the path; None when
    sleuth can read it. A FIFO, a device or a socket is refused before anything opens it (a FIFO with no
    writer blocks an open forever; /dev/zero never ends); a file or folder sleuth may not read is "permission
    denied", said as such, not taken for an empty or missing one."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except PermissionError:
        return "permission denied"
    except (OSError, ValueError) as exc:
        return f"cannot be read: {getattr(exc, 'strerror', None) or exc}"
    if stat.S_ISDIR(info.st_mode):
        if not directory_ok:
            return "is a directory, not a file"
        return None if os.access(path, os.R_OK | os.X_OK) else "permission denied"
    if not stat.S_ISREG(info.st_mode):
        return f"is {_kind(info.st_mode)}; sleuth reads only regular files and directories"
    if not file_ok:
        return "is a file, not a directory"
    return None if os.access(path, os.R_OK) else "permission denied"


def denied(path: Path) -> str | None:
    """"permission denied: PATH" when something is at `path` that sleuth may not read (a folder: list and
    enter), so an unreadable run, code tree or checkpoint is said as such, never taken for a missing or
    empty one; None otherwise (including when nothing is there)."""
    try:
        info = os.stat(path)
    except PermissionError:
        return f"permission denied: {shown(path)}"
    except (OSError, ValueError):
        return None
    want = os.R_OK | os.X_OK if stat.S_ISDIR(info.st_mode) else os.R_OK
    return None if os.access(path, want) else f"permission denied: {shown(path)}"


def named_path_error(option: str, path: Path, *, directory_ok: bool = True, file_ok: bool = True) -> str | None:
    """The one-line error for a path the user named with `option` ("--code"), or None when it is readable."""
    problem = named_path_problem(path, directory_ok=directory_ok, file_ok=file_ok)
    if problem is None:
        return None
    if problem == "permission denied":
        return f"permission denied: {shown(path)} ({option})" if option else f"permission denied: {shown(path)}"
    return f"{option} {shown(path)} {problem}".strip()


def exists(path: Path) -> bool:
    """Whether anything is at `path` (a dangling link counts), without raising."""
    try:
        os.lstat(path)
    except (OSError, ValueError):
        return False
    return True


def is_dir(path: Path, *, within: Path | None = None) -> bool:
    """A directory (a link to one only when it stays `within`); never raises."""
    try:
        if not stat.S_ISDIR(os.stat(path).st_mode):
            return False
    except (OSError, ValueError):
        return False
    return within is None or is_within(path, within)


def read_bytes(path: Path, *, within: Path | None = None, max_bytes: int = MAX_JSON_BYTES,
               head: bool = False) -> bytes:
    """The bytes of a regular file, at most `max_bytes` (more: ArtifactError, or with `head` the first
    `max_bytes`). FileNotFoundError when nothing is there; ArtifactError for anything else wrong."""
    fd = _open_regular(path, within)
    try:
        info = os.fstat(fd)
        if info.st_size > max_bytes and not head:
            raise ArtifactError(path, f"is {info.st_size} bytes, more than such a file can be ({max_bytes >> 10} KiB)")
        chunks, left = [], max_bytes + (0 if head else 1)
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as exc:
        raise ArtifactError(path, f"cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        if head:
            return data[:max_bytes]
        raise ArtifactError(path, f"grew past {max_bytes >> 10} KiB while being read")
    return data


def _open_regular(path: Path, within: Path | None) -> int:
    """A read-only descriptor of a regular file (not a FIFO: O_NONBLOCK, so no open waits for a writer);
    FileNotFoundError when nothing is there, ArtifactError for anything else wrong."""
    if not regular_file(path, within=within):
        raise FileNotFoundError(2, "No such file or directory", str(path))
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ArtifactError(path, f"cannot be read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise ArtifactError(path, f"cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):  # swapped between the stat and the open
        os.close(fd)
        raise ArtifactError(path, f"is {_kind(info.st_mode)}, not a regular file")
    return fd


_NOT_BLANK = re.compile(rb"[^ \t\r\n]")


class BoundedLines:
    """The lines of a regular file, streamed: at most `max_bytes` read in all (`truncated` says the file went
    on), a line longer than `max_line` bytes yielded as None and never held whole (its bytes are read and
    dropped), and `sha256` of the bytes read. Memory stays about `max_line` plus one read chunk, whatever the
    file's size (a sparse 40 GiB file is as cheap as a small one).

    Iterating yields (line number, bytes without the newline, or None); opening raises FileNotFoundError or
    ArtifactError as read_bytes does."""

    _CHUNK = 1 << 20

    def __init__(self, path: Path, *, within: Path | None, max_line: int, max_bytes: int,
                 skip_blank: bool = False) -> None:
        import hashlib

        self.path, self.within, self.max_line, self.max_bytes = path, within, max_line, max_bytes
        self.skip_blank = skip_blank  # lines of only spaces, tabs and CRs are not yielded (numbers stay right)
        self.truncated = False
        self.size = 0
        self._hash = hashlib.sha256()

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def __iter__(self) -> Iterator[tuple[int, bytes | None]]:
        fd = _open_regular(self.path, self.within)
        try:
            self.size = os.fstat(fd).st_size
            yield from self._lines(fd)
        except OSError as exc:
            raise ArtifactError(self.path, f"cannot be read: {exc.strerror or exc}") from None
        finally:
            os.close(fd)

    def _lines(self, fd: int) -> Iterator[tuple[int, bytes | None]]:
        number, pending, overlong, left = 1, bytearray(), False, self.max_bytes
        while left > 0:
            chunk = os.read(fd, min(left, self._CHUNK))
            if not chunk:
                break
            left -= len(chunk)
            self._hash.update(chunk)
            start = 0
            while True:
                if self.skip_blank and not pending and not overlong:
                    # Runs of blank lines skipped in C (counted, never yielded): a file of a billion newlines
                    # costs its read, not a billion Python iterations.
                    text = _NOT_BLANK.search(chunk, start)
                    last = chunk.rfind(b"\n", start, text.start() if text else len(chunk))
                    if last >= 0:
                        number += chunk.count(b"\n", start, last + 1)
                        start = last + 1
                end = chunk.find(b"\n", start)
                piece = chunk[start:] if end < 0 else chunk[start:end]
                if not overlong:
                    pending += piece
                    if len(pending) > self.max_line:  # drop what is held; read on to the line's end
                        overlong, pending = True, bytearray()
                if end < 0:
                    break
                yield number, None if overlong else bytes(pending)
                number, pending, overlong, start = number + 1, bytearray(), False, end + 1
        else:
            self.truncated = bool(os.read(fd, 1))
        if overlong or pending:
            yield number, None if overlong else bytes(pending)


def decode(data: bytes, path: Path | str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ArtifactError(path, f"is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") from None


def read_text(path: Path, *, within: Path | None = None, max_bytes: int = MAX_JSON_BYTES) -> str:
    return decode(read_bytes(path, within=within, max_bytes=max_bytes), path)


# --- JSON --------------------------------------------------------------------------------------------------


class _TooLong(ValueError):
    pass


def _bounded_int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise _TooLong(len(text))
    return int(text)


def _bounded_float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise _TooLong(len(text))
    return float(text)


def parse_json(text: str | bytes, where: Path | str) -> Any:
    """JSON under the bounds (depth, number length); ArtifactError naming `where` otherwise."""
    try:
        if isinstance(text, bytes):
            text = decode(text, where)
        data = json.loads(text, parse_int=_bounded_int, parse_float=_bounded_float)
    except _TooLong as exc:
        raise ArtifactError(where, f"holds a number {exc.args[0]} characters long (more than "
                                   f"{MAX_NUMBER_CHARS}): not a value such a file holds") from None
    except json.JSONDecodeError as exc:
        raise ArtifactError(where, f"is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    except RecursionError:
        raise ArtifactError(where, f"nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # a number the int parser refuses, anything else json raises
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ArtifactError(where, f"cannot be read as JSON: {first}") from None
    if _depth_exceeds(data, MAX_JSON_DEPTH):
        raise ArtifactError(where, f"nests deeper than {MAX_JSON_DEPTH} levels")
    return data


def _depth_exceeds(data: Any, limit: int) -> bool:
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def read_json(path: Path, *, within: Path | None = None, max_bytes: int = MAX_JSON_BYTES) -> Any:
    return parse_json(read_bytes(path, within=within, max_bytes=max_bytes), path)


def read_json_object(path: Path, *, within: Path | None = None, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any]:
    data = read_json(path, within=within, max_bytes=max_bytes)
    if not isinstance(data, dict):
        raise ArtifactError(path, f"holds {json_kind(data)}, not a JSON object")
    return data


def optional_json_object(path: Path, problems: list[str] | None, *, within: Path | None = None,
                         label: str | None = None, max_bytes: int = MAX_JSON_BYTES) -> dict[str, Any] | None:
    """A JSON object from `path`; None when the file is absent (silently) or damaged (with one problem
    line in `problems`, naming the file as `label`, else by its name)."""
    try:
        return read_json_object(path, within=within, max_bytes=max_bytes)
    except FileNotFoundError:
        return None
    except ArtifactError as exc:
        if problems is not None:
            problems.append(f"{label or shown(path.name)} {exc.reason}")
        return None


def json_kind(value: Any) -> str:
    """What a JSON value is, in the words of a message: 'a list', 'a string', 'null'."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", tuple: "a list", dict: "an object"}.get(type(value), type(value).__name__)


# --- shapes ------------------------------------------------------------------------------------------------

# What `check_shape` checks a field against.
OBJECT, LIST, STRING, NUMBER, INTEGER, BOOLEAN = "object", "list", "string", "number", "integer", "boolean"
SEQUENCE = "sequence"  # a list or a tuple: what torch.load gives for a pickled tuple
_CHECKS = {
    OBJECT: lambda v: isinstance(v, dict),
    LIST: lambda v: isinstance(v, list),
    SEQUENCE: lambda v: isinstance(v, (list, tuple)),
    STRING: lambda v: isinstance(v, str),
    NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    INTEGER: lambda v: isinstance(v, int) and not isinstance(v, bool),
    BOOLEAN: lambda v: isinstance(v, bool),
}
_WORDS = {OBJECT: "an object", LIST: "a list", SEQUENCE: "a list", STRING: "a string", NUMBER: "a number", INTEGER: "an integer",
          BOOLEAN: "true or false"}


def check_shape(data: dict[str, Any], shape: dict[str, str], where: str, problems: list[str]) -> dict[str, Any]:
    """Drop every field of `data` whose type is not what `shape` says, with one line per field in
    `problems` (`config.json: speculators_config.verifier is a string, not an object; ignored`).

    `shape` maps dotted keys to a kind; `key[]` means each entry of the list at `key` (e.g.
    `speculators_config.proposal_methods[]: object`). A null field counts as absent. Returns `data`,
    changed in place."""
    for dotted, kind in shape.items():
        for parent, key, label in _locate(data, dotted):
            value = parent[key] if isinstance(parent, dict) else parent[key]
            if value is None or _CHECKS[kind](value):
                continue
            problems.append(f"{where}: {label} is {json_kind(value)}, not {_WORDS[kind]}; ignored")
            if isinstance(parent, dict):
                del parent[key]
            else:
                parent[key] = None
    return data


def _locate(data: Any, dotted: str) -> Iterator[tuple[Any, Any, str]]:
    """(container, key, label) of every value `dotted` names (`a.b`, `a.b[]` for each entry of list a.b)."""
    each = dotted.endswith("[]")
    parts = dotted.removesuffix("[]").split(".")
    node = data
    for part in parts[:-1]:
        if not isinstance(node, dict) or not isinstance(node.get(part), dict):
            return
        node = node[part]
    if not isinstance(node, dict) or parts[-1] not in node:
        return
    if not each:
        yield node, parts[-1], dotted
        return
    values = node[parts[-1]]
    if isinstance(values, list):
        for index in range(len(values)):
            yield values, index, f"{dotted[:-2]}[{index}]"


# --- directories -------------------------------------------------------------------------------------------


def list_dir(path: Path, *, limit: int = 10_000) -> list[Path]:
    """The entries of a directory, sorted, at most `limit`; empty when it cannot be listed."""
    entries: list[Path] = []
    try:
        with os.scandir(path) as scan:
            for entry in scan:
                entries.append(Path(path) / entry.name)
                if len(entries) >= limit:
                    break
    except (OSError, ValueError):
        return []
    return sorted(entries)


def find_files(root: Path, matches: Any, *, max_depth: int, max_entries: int = 20_000,
               skip_dirs: frozenset[str] | set[str] = frozenset()) -> tuple[list[Path], bool]:
    """Regular files under `root` whose name `matches(name)`: no link followed (files or folders), at most
    `max_depth` folders down and `max_entries` entries looked at, folders named in `skip_dirs` left out.
    (files, True when a bound cut it short)."""
    found: list[Path] = []
    seen = 0
    stack: list[tuple[Path, int]] = [(Path(root), 0)]
    while stack:
        folder, depth = stack.pop()
        try:
            with os.scandir(folder) as scan:
                entries = sorted(scan, key=lambda e: e.name)
        except (OSError, ValueError):
            continue
        for entry in entries:
            seen += 1
            if seen > max_entries:
                return sorted(found), True
            try:
                if entry.is_symlink():
                    continue
                if entry.is_dir(follow_symlinks=False):
                    if depth < max_depth and entry.name not in skip_dirs:
                        stack.append((Path(entry.path), depth + 1))
                elif entry.is_file(follow_symlinks=False) and matches(entry.name):
                    found.append(Path(entry.path))
            except OSError:
                continue
    return sorted(found), False


# --- writing -----------------------------------------------------------------------------------------------


class WriteRefused(OSError):
    """A report directory or file that sleuth will not write into (a link, a special file)."""


def prepare_dir(path: Path, *, allow_link: bool) -> Path:
    """Create `path` (and its parents) if missing; refuse a link (unless `allow_link`: a directory the user
    named) and anything that is not a directory."""
    if os.path.islink(path) and not allow_link:
        raise WriteRefused(f"{shown(path)} is a link; sleuth writes only into a real directory there (--out DIR "
                           "picks another)")
    try:
        os.makedirs(path, exist_ok=True)
    except FileExistsError:
        raise WriteRefused(f"{shown(path)} exists and is not a directory") from None
    if not os.path.isdir(path):
        raise WriteRefused(f"{shown(path)} exists and is not a directory")
    return Path(path)


def write_atomic(path: Path, data: bytes | str, *, mode: int = 0o666, replace: str = "any") -> None:
    """Write `data` to `path` by rename: a fresh O_EXCL | O_NOFOLLOW temporary file in the same (real)
    directory, then os.replace over the name. Nothing at `path` is ever opened, followed or written through.

    `replace` says what may be at `path` already: "any" (sleuth's own output folder: a link to ~/.bashrc or a
    FIFO planted there is replaced, the file it names untouched), "regular" (a file in a tree sleuth does not
    own, such as `probe init --force` beside the user's code: only a regular file is replaced; a link, dangling
    or not, a FIFO, a device or a socket is refused: sleuth did not put it there), "none" (nothing may be
    there). A directory is always refused."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    path = Path(path)
    dir_flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        dir_fd = os.open(path.parent, dir_flags)
    except OSError as exc:
        raise WriteRefused(exc.errno, f"{shown(path.parent)} is not a real directory ({exc.strerror})") from None
    try:
        if _is_directory_at(path.name, dir_fd):
            raise WriteRefused(f"{shown(path)} is a directory; not replaced")
        if replace != "any":
            there = _kind_at(path.name, dir_fd)
            if there is not None and (replace == "none" or there != "a regular file"):
                raise WriteRefused(f"{shown(path)} is {there}; sleuth did not create it and does not replace it")
        temporary = f".{path.name}.{secrets.token_hex(8)}.partial"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(temporary, flags, mode, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(payload)
            os.replace(temporary, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            try:
                os.unlink(temporary, dir_fd=dir_fd)
            except OSError:
                pass
            raise
    finally:
        os.close(dir_fd)


def _is_directory_at(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _kind_at(name: str, dir_fd: int) -> str | None:
    """What is at `name` in `dir_fd` (links not followed), in words; None when nothing is."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(mode):
        return "a link"
    return "a regular file" if stat.S_ISREG(mode) else _kind(mode)
