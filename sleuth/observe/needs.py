"""What an observed command needs from outside its code copy, and what it lacked when it could not run here.

Two questions, both answered from the command itself, never from which trainer it is:

* `named_inputs`: the files the user prepared for the command (a target model, a feature cache, a data set)
  are the paths its arguments name, directly (`--data /cache/hs`), as `KEY=VALUE` (`--set target=/m`), or
  inside a JSON/YAML config file an argument names (one level). Those that exist outside the code copy are
  made visible to the command read-only, at the same path; nothing else of the user's files is.
* `missing_need`: a command that ended without a training step is read from the end of its error output,
  and the first thing it lacked that this sandbox cannot give (a GPU, a server, a module, a file) becomes one
  line that says so.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

MAX_INPUTS = 32  # paths taken from one command (and its config files)
MAX_CONFIG_BYTES = 1 << 20  # a config file larger than this is not read for paths
CONFIG_SUFFIXES = (".json", ".yaml", ".yml")


# Where credentials and the system's own state live: never opened to the observed command, whoever names them
# (a config file in a checkout is not the user's word).
_SYSTEM = ("/etc", "/root", "/proc", "/sys", "/dev", "/run", "/var", "/boot")


# Model and dataset caches (~/.cache/huggingface) are inputs a step needs; the credentials kept beside them are not.
_CACHES = (".cache",)
_CREDENTIAL = ("token", "credential", "secret", "password", "netrc", "id_rsa", "id_ed25519")


def _private(path: Path) -> bool:
    """A hidden file or folder other than a cache (~/.ssh, ~/.aws, ~/.config, a .env), a credential's name, or
    one of the system's own folders: refused."""
    text = str(path)
    hidden = any(part.startswith(".") and part not in (".", "..", *_CACHES) for part in path.parts)
    named = any(word in path.name.lower() for word in _CREDENTIAL)
    return hidden or named or any(text == root or text.startswith(root + "/") for root in _SYSTEM)


def named_inputs(command: list[str], cwd: Path, code: Path) -> list[Path]:
    """The existing paths the command names (directly, as KEY=VALUE, or in a config file it names) that lie
    outside `code`, resolved; at most MAX_INPUTS."""
    found: dict[Path, None] = {}

    def consider(word: str, base: Path) -> Path | None:
        if not word or "\0" in word or len(word) > 4096 or word.startswith("-"):
            return None
        candidate = Path(os.path.expanduser(word))
        candidate = candidate if candidate.is_absolute() else base / candidate
        try:
            if not candidate.exists():
                return None
            resolved = candidate.resolve()
        except (OSError, RuntimeError, ValueError):
            return None
        inside = resolved == code or code in resolved.parents
        if (not inside and resolved != Path("/") and not _private(resolved) and len(found) < MAX_INPUTS
                and not any(p == resolved or p in resolved.parents for p in found)):
            found[resolved] = None
        return resolved

    for word in command[1:]:
        for part in _words(word):
            path = consider(part, cwd)
            if path is not None and path.is_file() and path.suffix.lower() in CONFIG_SUFFIXES:
                for value in _config_strings(path):
                    consider(value, path.parent)
                    consider(value, cwd)
    return list(found)


def unreadable_by_others(paths: list[Path], limit: int = 2000) -> list[Path]:
    """Of the inputs (and the files in them, a bounded walk), those other users cannot read: the observed
    command runs as an unprivileged user where sleuth isolates it with namespaces, so it cannot read them."""
    import stat

    found: list[Path] = []
    seen = 0
    for root in paths:
        walk = [root]
        while walk and seen < limit and len(found) < 8:
            path = walk.pop()
            seen += 1
            try:
                mode = path.stat().st_mode
            except OSError:
                continue
            wanted = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
            if mode & wanted != wanted:
                found.append(path)
                continue
            if stat.S_ISDIR(mode):
                try:
                    walk.extend(sorted(path.iterdir())[:limit])
                except OSError:
                    continue
    return found


def _words(word: str) -> list[str]:
    """The argument, and its value when it is `--flag=VALUE` or `KEY=VALUE`."""
    if "=" in word:
        return [word, word.split("=", 1)[1]]
    return [word]


def _config_strings(path: Path) -> list[str]:
    """Every string value of a JSON or YAML config (bounded); nothing when it cannot be read as one."""
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            return []
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            from sleuth.safe_yaml import load_yaml

            data = load_yaml(text)
    except Exception:  # noqa: BLE001 - not a config we can read: its paths are not offered, nothing more
        return []
    strings: list[str] = []
    stack = [data]
    while stack and len(strings) < 4 * MAX_INPUTS:
        item = stack.pop()
        if isinstance(item, str):
            strings.append(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return strings


# (pattern over the error output, what the command needed): the first that matches, searched from the end.
_NEEDS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Torch not compiled with CUDA|no NVIDIA driver|Cannot access accelerator device|Found no NVIDIA driver|CUDA (?:is not available|"
                r"driver|error: no CUDA-capable)|cuda(?:\.is_available\(\))? (?:is )?not available|"
                r"No CUDA GPUs are available|NCCL|nvidia-smi", re.I),
     "a CUDA GPU, and the observed command sees none (torch.cuda is not available: sleuth hides GPUs from it"
     " and runs it on the CPU); give it a CPU device option if it has one"),
    (re.compile(r"ConnectionRefusedError|Connection refused|Failed to establish a new connection|"
                r"Network is unreachable|Name or service not known|Temporary failure in name resolution|"
                r"Max retries exceeded|ConnectError", re.I),
     "a server or the network ({detail}), and the observed command has no network: start nothing it must reach, "
     "or give it local files"),
    (re.compile(r"ModuleNotFoundError: No module named '([^']+)'"),
     "the Python module {group} (not importable by {python}: give --probe-python an environment that has it)"),
    (re.compile(r"Read-only file system[^\n]*?['\"]([^'\"\n]+)['\"]"),
     "to write to {group}, which the observed command sees read-only (your files are never writable to it): give "
     "it an output path inside the code or relative to where it runs"),
    (re.compile(r"(?:FileNotFoundError|OSError|No such file or directory)[^\n]*?['\"]([^'\"\n]+)['\"]"),
     "the file {group}, which the observed command cannot see: it runs in a copy of the code and sees, of your "
     "other files, only the paths its arguments name (directly, as KEY=VALUE, or in a config file it names)"),
    (re.compile(r"PermissionError[^\n]*?['\"]([^'\"\n]+)['\"]"),
     "read access to {group}: the observed command runs as an unprivileged user (nobody), so what it reads must "
     "be readable by others (chmod o+r)"),
)


def missing_need(error_output: str, python: str) -> str | None:
    """One line on what the command needed and this sandbox did not give, from its error output; None when
    nothing in it says."""
    lines = [line.strip() for line in error_output.splitlines() if line.strip()]
    for line in reversed(lines[-60:]):
        for pattern, need in _NEEDS:
            match = pattern.search(line)
            if match is None:
                continue
            group = match.group(1) if match.groups() else ""
            return "it needs " + need.format(group=group, detail=line[:160], python=python)
    return None
