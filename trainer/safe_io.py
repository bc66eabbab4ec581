"""The trainer's one way to write a file, to read a file a user names, and to show a value from a file.

Writing (`write_bytes`, `write_text`, `write_json`, `staged_path`): the data goes into a temporary file that
this process creates itself (O_CREAT | O_EXCL | O_NOFOLLOW, a random name in the final file's directory, so
a link or a file planted there under a predictable name is never written through), is fsync'd, and is
renamed over the final name. A final name that is a symbolic link or anything but a regular file (a FIFO,
a device, a socket, a directory) is refused: the trainer never created it, and replacing it would hide
where the user's link pointed. A kill leaves at most a `.<name>.<random>.tmp` beside the file, never a torn
file under the real name. Writers that only take a path (safetensors' save_file) get one inside a private
0700 directory made for the write (`staged_path`), where no other user can plant anything.

Reading (`check_readable_file`, `read_limited`, `loads_json`): a path a user names must be a regular file: a
FIFO would block the read forever and a device never ends. JSON is parsed with its nesting bounded, so a
deeply nested document is one error naming the file instead of a RecursionError.

Showing (`escape_unsafe`): a value read from a file can hold ESC (a terminal sequence), a terminal-title
OSC, a bidirectional override (U+202E) or invisible characters; every such code point is written as a
visible escape before it reaches a terminal. The rule is the one sleuth uses (sleuth.codepoints), restated
here because the trainer never imports sleuth.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# Deeper than any config, manifest or record the trainer or a drafter's config uses (a few levels).
MAX_JSON_DEPTH = 64


class UnsafeFileError(Exception):
    """A path the trainer would write through or read from is a link or a special file: one line naming it."""


# --- showing ------------------------------------------------------------------------------------------------
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
_INVISIBLE_GRAPHIC = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u3164\uffa0")


def _is_unsafe(ch: str) -> bool:
    if ch.isprintable():
        return ch in _INVISIBLE_GRAPHIC
    return unicodedata.category(ch) in _UNSAFE_CATEGORIES


def _escaped(ch: str) -> str:
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:  # a byte of a non-UTF-8 file name (surrogateescape): the byte itself
        return f"\\x{code - 0xDC00:02x}"
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape_unsafe(text: str) -> str:
    """`text` with every control, format (bidi, zero-width), separator-line, private or unassigned code point
    written as `\\xNN` / `\\uNNNN` / `\\UNNNNNNNN`; everything else unchanged."""
    if text.isprintable() and not any(ch in _INVISIBLE_GRAPHIC for ch in text):
        return text
    return "".join(_escaped(ch) if _is_unsafe(ch) else ch for ch in text)


# --- writing ------------------------------------------------------------------------------------------------


def check_write_target(path: Path) -> None:
    """Refuse a final name that is a link or not a regular file: the trainer writes only files of its own."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeFileError(f"{path} is a symbolic link (to {os.readlink(path)}); refusing to write through or "
                              "over it: remove the link or choose another path")
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFileError(f"{path} exists and is not a regular file ({_kind(info.st_mode)}); refusing to "
                              "write over it")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "a special file"


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes, *, mode: int = 0o666) -> None:
    """Write `data` as `path`, atomically, through a temporary file this process created (see the module).
    `mode` is masked by the umask, as for any new file (0o600 for a private record)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_write_target(path)
    tmp = _temporary_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), mode)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        check_write_target(path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_text(path: Path, text: str, *, mode: int = 0o666) -> None:
    write_bytes(path, text.encode("utf-8"), mode=mode)


def write_json(path: Path, data: Any, *, indent: int | None = 2, mode: int = 0o666) -> None:
    write_text(path, json.dumps(data, indent=indent) + "\n", mode=mode)


@contextmanager
def staged_path(path: Path, *, mode: int = 0o666) -> Iterator[Path]:
    """A path to hand a writer that only takes a path (safetensors' save_file); on a clean exit the file it
    wrote is fsync'd and renamed over `path`. The path lies in a fresh 0700 directory next to `path`: nobody
    else can create anything in it, so the writer's own open cannot be led through a planted link."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    check_write_target(path)
    private = _temporary_name(path)
    os.mkdir(private, 0o700)
    staged = private / path.name
    try:
        yield staged
        fd = os.open(staged, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise UnsafeFileError(f"{staged} is not a regular file after writing it; refusing to publish it")
            os.fsync(fd)
        finally:
            os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staged, mode & ~umask)
        check_write_target(path)
        os.replace(staged, path)
        _fsync_dir(path.parent)
    finally:
        for leftover in (staged, private):
            try:
                leftover.rmdir() if leftover == private else leftover.unlink(missing_ok=True)
            except OSError:
                pass


# --- reading ------------------------------------------------------------------------------------------------


def check_readable_file(path: Path, what: str = "") -> os.stat_result:
    """Stat `path` (following links, as reading does) and refuse anything but a regular file; a missing file
    and a permission problem raise the OSError they are."""
    info = os.stat(path)
    if not stat.S_ISREG(info.st_mode):
        label = f"{what} " if what else ""
        raise UnsafeFileError(f"{label}{path} is {_kind(info.st_mode)}, not a regular file; refusing to read it")
    return info


def read_limited(path: Path, limit: int, what: str = "") -> bytes:
    """A regular file's bytes, refused when larger than `limit`; read through one descriptor opened
    without blocking (a FIFO swapped in after the check cannot hang the read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        label = f"{what} " if what else ""
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFileError(f"{label}{path} is {_kind(info.st_mode)}, not a regular file; refusing to read it")
        if info.st_size > limit:
            raise UnsafeFileError(f"{label}{path} is {info.st_size} bytes, more than {limit}; refusing to read it")
        with os.fdopen(os.dup(fd), "rb") as handle:
            return handle.read(limit + 1)[:limit]
    finally:
        os.close(fd)


class JsonTooDeep(ValueError):
    """A JSON document nests deeper than MAX_JSON_DEPTH."""


def loads_json(text: str | bytes, **kwargs: Any) -> Any:
    """json.loads with the nesting bounded at MAX_JSON_DEPTH (JsonTooDeep, a ValueError, beyond it): a deep
    document is refused, never a RecursionError in the parser or in any code that walks the result later."""
    try:
        data = json.loads(text, **kwargs)
    except RecursionError:
        raise JsonTooDeep(f"nests deeper than {MAX_JSON_DEPTH} levels") from None
    if json_depth(data) > MAX_JSON_DEPTH:
        raise JsonTooDeep(f"nests deeper than {MAX_JSON_DEPTH} levels")
    return data


def json_depth(value: Any) -> int:
    """The nesting depth of a parsed JSON value, counted without recursion (a scalar is 0)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        stack.extend((child, depth) for child in children)
    return deepest
