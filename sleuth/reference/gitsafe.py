"""Every git command sleuth runs goes through `run_git`: git as a trusted tool uses it on a stranger's repository.

A repository's own configuration is code: `core.fsmonitor`, hooks, filter drivers, `remote.*.uploadpack`,
`core.sshCommand`, credential helpers, `gpg.program` behind `merge.verifySignatures`, `core.worktree` ...
each names a command or a path git would run or write. A checkout handed to sleuth (`--path`,
`--reference-path`, the environment, the config file) is as foreign as the code it holds, so every call here:

  * starts from sleuth's environment minus every `GIT_*` variable (a caller's `GIT_DIR`, `GIT_WORK_TREE`,
    `GIT_INDEX_FILE`, `GIT_CONFIG_*`, `GIT_EXEC_PATH`, `GIT_SSH*`, `GIT_ASKPASS`, `GIT_TEMPLATE_DIR`, ... would
    point git at another repository or another program), then sets only what it needs;
  * names the repository explicitly (`--git-dir`, `--work-tree`): no discovery, no `core.worktree`;
  * overrides, on the command line (which outranks every configuration file), each setting that runs
    something: hooks point at a path that holds none, fsmonitor off, every configured filter driver emptied,
    signatures not verified, no credential helper, no askpass, no automatic gc or maintenance;
  * allows only the transports named here (`GIT_ALLOW_PROTOCOL`, which no configuration widens), and none
    at all when the caller says no network: `ext::` and `fd::` (a command line as a URL) never;
  * fetches with an explicit `--upload-pack`, so `remote.*.uploadpack` in the repository's config is never run;
  * never prompts, reads nothing from a terminal, and is killed with its process group at its deadline.

A repository owned by another user (git's `safe.directory` reasoning) is read only: `owned_by_someone_else`
tells the callers, which then neither fetch into it nor move its branch.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from sleuth.process import run_in_own_group
from sleuth.redact import redact

GIT_TIMEOUT_S = 120.0
# Transports git may use when the network is allowed: https for the references, http and file for mirrors and
# local copies the user made, ssh through the fixed GIT_SSH_COMMAND below. Never ext:: or fd:: (a command as
# a URL) nor git:// (whose core.gitProxy is a command).
NETWORK_PROTOCOLS = ("https", "http", "ssh", "file")
# A name no transport has: no transport at all (a partial clone's lazy fetch inside `cat-file` fails at once).
NO_TRANSPORT = "sleuth-no-network"
# Where git looks for hooks: a path below a character device is never a directory, so no hook exists there.
NO_HOOKS = os.devnull
TRUSTED_UPLOAD_PACK = "git-upload-pack"

# Settings that run a program or write elsewhere, with the value that makes them inert. They are given on the
# command line, which git reads last and which no repository, global or system file can override.
FIXED_CONFIG: tuple[tuple[str, str], ...] = (
    ("core.hooksPath", NO_HOOKS),
    ("core.fsmonitor", "false"),
    ("core.askPass", ""),  # empty: no askpass program (and GIT_TERMINAL_PROMPT=0: no prompt)
    ("credential.helper", ""),  # empty resets every helper read before it, URL-specific ones included
    ("core.alternateRefsCommand", ""),
    ("core.sshCommand", "ssh -o BatchMode=yes -o ConnectTimeout=5"),
    ("merge.verifySignatures", "false"),  # else gpg.program from the repository's config runs
    ("log.showSignature", "false"),
    ("diff.external", ""),
    ("gc.auto", "0"),
    ("maintenance.auto", "false"),
    ("fetch.writeCommitGraph", "false"),
    ("fetch.recurseSubmodules", "false"),
    ("submodule.recurse", "false"),
    ("protocol.allow", "never"),
    ("core.pager", "cat"),
)


class GitFailure(Exception):
    """A git command failed or timed out; the message is one short line."""


def git_environment(*, network: bool) -> dict[str, str]:
    """sleuth's environment without any GIT_* variable, plus the settings every call needs."""
    env = {key: value for key, value in os.environ.items() if not key.upper().startswith("GIT_")}
    for key in ("SSH_ASKPASS", "GCM_INTERACTIVE", "PAGER"):
        env.pop(key, None)
    env.update({
        "GIT_CONFIG_NOSYSTEM": "1",  # the system file is not the user's either
        "GIT_TERMINAL_PROMPT": "0",  # never wait for a human
        "GCM_INTERACTIVE": "never",
        # Outranks core.sshCommand of any configuration file: BatchMode never asks, ConnectTimeout bounds it.
        "GIT_SSH_COMMAND": "ssh -o BatchMode=yes -o ConnectTimeout=5",
        "GIT_SSH_VARIANT": "ssh",
        "GIT_PAGER": "cat",
        "GIT_OPTIONAL_LOCKS": "0",  # a status must not rewrite the user's index stat cache
        "GIT_PROTOCOL_FROM_USER": "0",
        "GIT_ATTR_NOSYSTEM": "1",
        "LC_ALL": "C",
        "GIT_ALLOW_PROTOCOL": ":".join(NETWORK_PROTOCOLS) if network else NO_TRANSPORT,
    })
    if not network:
        env["GIT_NO_LAZY_FETCH"] = "1"  # git >= 2.44 says the same for partial clones
    return env


def _config_args(extra: list[tuple[str, str]]) -> list[str]:
    args: list[str] = []
    for key, value in [*FIXED_CONFIG, *extra]:
        args += ["-c", f"{key}={value}"]
    return args


def run_git(args: list[str], *, git_dir: Path | None, work_tree: Path | None, network: bool,
            binary: bool = False, timeout: float = GIT_TIMEOUT_S, safe_directory: Path | None = None,
            extra_config: list[tuple[str, str]] | None = None, cwd: Path | None = None) -> str | bytes:
    """Run `git ARGS` on the repository at git_dir (and work_tree), under the rules of the module docstring.

    `safe_directory`: a repository owned by someone else that the caller has decided to read anyway (its
    configuration can run nothing here); `extra_config`: per-repository overrides (its filter drivers)."""
    command = ["git"]
    if git_dir is not None:
        command += ["--git-dir", str(git_dir)]
    if work_tree is not None:
        command += ["--work-tree", str(work_tree)]
    extra = list(extra_config or [])
    if safe_directory is not None:
        extra.append(("safe.directory", str(safe_directory)))
    protocols = [(f"protocol.{name}.allow", "always") for name in NETWORK_PROTOCOLS] if network else []
    command += _config_args(protocols) + list(args)
    env = git_environment(network=network)
    if extra:
        # Through the environment, not `-c`: a name from the repository's config (a filter driver's) may hold
        # '=', which `-c` would split at. Same rank as `-c` (git >= 2.31; older git is refused, not trusted).
        _require_config_env()
        env["GIT_CONFIG_COUNT"] = str(len(extra))
        for index, (key, value) in enumerate(extra):
            env[f"GIT_CONFIG_KEY_{index}"], env[f"GIT_CONFIG_VALUE_{index}"] = key, value
    where = cwd or work_tree or git_dir or Path.cwd()
    try:
        returncode, out, err = run_in_own_group(command, env=env, cwd=where, timeout=timeout)
    except OSError as exc:
        raise GitFailure(f"cannot run git: {exc.strerror or exc}") from None
    except subprocess.TimeoutExpired:
        raise GitFailure(f"git {args[0]} did not finish within {timeout:g} s") from None
    if returncode != 0:
        lines = [line.strip() for line in err.decode("utf-8", "replace").splitlines() if line.strip()]
        # git's stderr names the remote URL, token included when the user put one there.
        raise GitFailure(redact(f"git {args[0]} failed: {lines[-1] if lines else returncode}"))
    if binary:
        return out
    return out.decode("utf-8", "replace").rstrip("\n")


_GIT_VERSION: list[tuple[int, ...]] = []


def _require_config_env() -> None:
    if not _GIT_VERSION:
        text = str(run_git(["--version"], git_dir=None, work_tree=None, network=False, timeout=30))
        numbers = re.findall(r"\d+", text)[:2]
        _GIT_VERSION.append(tuple(int(n) for n in numbers) if len(numbers) == 2 else (0, 0))
    if _GIT_VERSION[0] < (2, 31):
        raise GitFailure("git older than 2.31 cannot be told to ignore a repository's filter drivers; "
                         "install a newer git")


def owned_by_someone_else(*paths: Path) -> int | None:
    """The owner uid of the first of `paths` not owned by the effective user (git's safe.directory test);
    None when all are the user's. root reading a sudo user's checkout counts as that user's, as git does."""
    me = os.geteuid()
    sudo_uid = os.environ.get("SUDO_UID", "")
    for path in paths:
        try:
            owner = os.stat(path).st_uid
        except OSError:
            continue
        if owner == me or (me == 0 and sudo_uid.isdecimal() and owner == int(sudo_uid)):
            continue
        return owner
    return None
