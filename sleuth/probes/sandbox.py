"""The probe child's isolation: what it can see, reach and spend, and the guarantee that it is gone after.

Whatever code a probe runs (the user's own trainer or a stranger's `code/`), the child process gets:
  * a scratch box (`Box`) holding copies of everything it needs (the code, the run's config, sleuth's
    worker), read-only to it, and a scratch folder (its HOME, TMPDIR and cwd) that is a size-capped tmpfs
    where namespaces allow: it never sees the run directory or the user's files, and the box is deleted
    after (iteratively: no tree the child builds makes the removal fail);
  * when sleuth is root, another uid (nobody): a child with sleuth's own uid could write sleuth's files
    (the trust record among them), read its memory and environment, signal it;
  * an environment built from an allowlist (`child_environment`): no tokens, keys or agent sockets;
  * resource limits (`Limits`): address space, CPU time, file size (which caps its stdout, stderr and
    answer: they go to files, never to pipes sleuth would wait on), open files, processes (RLIMIT_NPROC of
    the child's uid: a cap on the whole probe once that uid is nobody, not sleuth's user);
  * its own session, killed with SIGKILL at the end, then a sweep for anything that left it;
  * the strongest isolation the machine allows (`ISOLATION_LEVELS`), recorded in `Isolation` for the report:
      - `bwrap`: bubblewrap, where installed: new user/PID/network/IPC/UTS namespaces, a read-only
        allowlist view of the file system with the box the only writable path, all capabilities dropped;
        devices only the harmless few in its own /dev (every bind is nodev), and no unix socket: a socket
        file in a folder the view must show is reachable through a read-only bind, so a seccomp filter
        (confine.refuse_unix_sockets) refuses every AF_UNIX socket (abstract ones and TCP are the empty
        network namespace's);
      - `namespaces`: the same with util-linux `unshare` and sleuth's own set-up step (confine.py): as
        root, or as a user where unprivileged user namespaces are enabled; the child is never global
        root (nobody, in a user namespace of its own), /proc's host-global parts are read-only and the
        kernel keyrings are fresh;
      - `process`: neither is available: the limits, the scratch environment, the dropped capabilities
        and the session kill hold, but the network is refused only in-process and the user's files stay
        reachable; as root the child is nobody, so root's files and sleuth itself are out of its reach,
        but as a user the child has the user's uid and can signal sleuth (docs/security.md).
    `SLEUTH_PROBE_ISOLATION` = auto (default) | bwrap | namespaces | process forces one level; a forced
    level that cannot be set up is an error, never a silent fallback.

Standard library only on this side; confine.py runs inside the namespaces before the worker starts.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sleuth.process import run_in_own_group

ISOLATION_ENV = "SLEUTH_PROBE_ISOLATION"
ISOLATION_LEVELS = ("bwrap", "namespaces", "process")
CONFINE = Path(__file__).resolve().with_name("confine.py")

# The only variables of sleuth's own environment a probe child inherits (LC_* too); everything it needs
# besides is set explicitly by child_environment.
ENV_PASSTHROUGH = frozenset({"PYTHONPATH", "LANG", "LANGUAGE", "TZ", "PYTHONHASHSEED"})
# What a probe reads of the machine besides its interpreter: the system, the loader's cache, the CPU topology.
SYSTEM_READ_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
                     "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/passwd", "/etc/group",
                     "/etc/nsswitch.conf", "/etc/hosts", "/sys/devices/system/cpu")
TAIL_BYTES = 8192  # how much of the child's stdout/stderr sleuth reads back (the end, where errors are)

_PR_SET_CHILD_SUBREAPER, _PR_SET_DUMPABLE = 36, 4
# The uid/gid a root sleuth's probe child runs as, when the system has no `nobody` entry.
NOBODY = (65534, 65534)
# The child's writable scratch (HOME, TMPDIR, cwd) where namespaces allow a tmpfs: its whole disk use.
SCRATCH_BYTES = 512 * 2**20
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
# Levels that failed to set up in this process, with why: not retried for every probe.
_FAILED_LEVELS: dict[str, str] = {}
# Process-level probes running now (several threads may probe at once): one probe's sweep never takes
# another's child for an orphan; sleuth stays a subreaper while any of them runs.
_LOCK = threading.Lock()
_LIVE: set[int] = set()
_REAPING = [0]


class SandboxError(Exception):
    """The probe could not be isolated as required (a forced level that is unavailable); one line."""


@dataclass(frozen=True)
class Limits:
    """Per-process limits of the probe child (setrlimit), and what sleuth reads back of its output."""

    address_space: int = 16 * 2**30
    cpu_seconds: int = 900
    file_size: int = 64 * 2**20  # any file it writes: stdout, stderr, the answer, scratch files
    open_files: int = 1024
    processes: int = 256  # tasks beyond those the child's uid already runs (the kernel does not apply it to root)
    scratch_bytes: int = SCRATCH_BYTES  # the scratch tmpfs (namespace levels)
    answer_bytes: int = 4 * 2**20

    @classmethod
    def for_timeout(cls, timeout_s: float, threads: int) -> Limits:
        # CPU time is summed over threads; the wall-clock limit stops it first in a normal run.
        return cls(cpu_seconds=int(timeout_s * max(threads, 1)) + 30, scratch_bytes=SCRATCH_BYTES)


@dataclass
class Isolation:
    """The isolation a probe actually got, as the report shows it."""

    level: str  # one of ISOLATION_LEVELS
    network: str
    filesystem: str
    processes: str
    privileges: str
    limits: dict[str, int | str] = field(default_factory=dict)
    fallback: str | None = None  # why a stronger level was not obtained
    uid: int | None = None  # the child's uid as the host sees it
    user_namespace: str | None = None  # "own", or why not
    keyring: str | None = None  # "fresh" session keyring, or why the user's

    def summary(self) -> str:
        text = f"{self.level}: network {self.network}; file system {self.filesystem}; processes {self.processes}"
        return text + (f" ({self.fallback})" if self.fallback else "")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def describe_level(level: str, limits: Limits, fallback: str | None = None,
                   got: dict[str, Any] | None = None) -> Isolation:
    """The isolation record; `got` is what the set-up step reported it obtained (namespace levels)."""
    identity = child_ids()
    got = got or {}
    shown: dict[str, int | str] = {
        "address_space_bytes": limits.address_space, "cpu_seconds": limits.cpu_seconds,
        "file_size_bytes": limits.file_size, "open_files": limits.open_files,
        "extra_processes": limits.processes, "answer_bytes": limits.answer_bytes,
        # No cgroup is set up: the whole probe's memory is bounded only as processes x address space.
        "total_memory": "not capped (no cgroup): extra_processes x address_space_bytes at most",
    }
    if level == "process":
        shown["scratch_bytes"] = "not capped (on disk; file_size_bytes per file)"
        if identity is None:
            who = "the user's uid (it can signal sleuth and write your files), every capability dropped, no_new_privs"
        else:
            who = f"uid {identity[0]} (not sleuth's root), no capabilities, no_new_privs"
        return Isolation(level, network="open (connections refused in-process only)",
                         filesystem="the user's files are readable and writable (scratch HOME/TMPDIR/cwd, copies)"
                         if identity is None else "what uid nobody may read and write on this machine "
                         "(scratch HOME/TMPDIR/cwd, copies)",
                         processes="own session, killed at the end; orphans swept", privileges=who, limits=shown,
                         fallback=fallback, uid=identity[0] if identity else os.getuid(), user_namespace=None,
                         keyring="fresh" if identity is not None else "the user's")
    shown["scratch_bytes"] = limits.scratch_bytes
    if level == "bwrap":  # only ever as a user (see _unavailable): bwrap's own user namespace, the user's uid
        got = {"user_namespace": "own", "session_keyring": "fresh",
               "unix_sockets": "refused (seccomp: no AF_UNIX socket)", **got}
    host_uid = identity[0] if identity else os.getuid()
    unix = got.get("unix_sockets", "unknown")
    return Isolation(level, network=f"closed (own network namespace, no interface up); unix sockets: {unix}",
                     filesystem="read-only view of the system and the probe interpreter (host-global /proc parts "
                                "read-only); a size-capped scratch tmpfs and the answer file the only writable "
                                "paths; home, run and other files not visible",
                     processes="own PID namespace, all killed at the end",
                     privileges=f"uid {host_uid} as the host sees it, user namespace: "
                                f"{got.get('user_namespace', 'unknown')}; all capabilities dropped, no_new_privs",
                     limits=shown, fallback=fallback, uid=host_uid, user_namespace=got.get("user_namespace"),
                     keyring=got.get("session_keyring"))


def child_ids() -> tuple[int, int] | None:
    """The uid/gid a root sleuth's child becomes (nobody); None when sleuth is not root (the child keeps the
    user's uid: it cannot become anyone else)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    import grp
    import pwd

    try:
        entry = pwd.getpwnam("nobody")
        uid, gid = entry.pw_uid, entry.pw_gid
    except KeyError:
        return NOBODY
    for group in ("nogroup", "nobody"):
        try:
            gid = grp.getgrnam(group).gr_gid
            break
        except KeyError:
            continue
    return (uid, gid) if uid != 0 else NOBODY


# --- the scratch box -----------------------------------------------------------------------------------


@dataclass
class Box:
    """The scratch directory of one probe. `root` is sleuth's (0711: only a child of another uid passes
    through it); `box` inside it is all the child sees of it, read-only but for scratch/ (home/, tmp/, work/:
    its HOME, TMPDIR and cwd) and answer.json: lib/ (sleuth's worker), code/ (the copied code), run/ (copied
    run files), spec.json. logs/ (0700: its stdout/stderr files, the marker) and newroot/ stay outside."""

    root: Path

    @classmethod
    def create(cls) -> Box:
        root = Path(os.path.realpath(tempfile.mkdtemp(prefix="sleuth-probe-")))
        box = cls(root)
        for folder in (box.logs, box.newroot, box.home, box.tmp, box.work, box.lib, box.code, box.run):
            folder.mkdir(parents=True, exist_ok=True)
        box.logs.chmod(0o700)
        return box

    def hand_over(self, identity: tuple[int, int] | None) -> None:
        """Make the scratch and the answer file the child's (another uid when sleuth is root), the rest of
        the box readable to it, nothing else of sleuth's writable by it."""
        self.answer.touch(mode=0o600)
        if identity is None:
            return
        self.root.chmod(0o711)
        for folder, _dirs, names in os.walk(self.box):  # whatever sleuth's umask made of the copies
            os.chmod(folder, 0o755)
            for name in names:
                os.chmod(os.path.join(folder, name), 0o644)
        for path in (self.scratch, self.home, self.tmp, self.work):
            os.chown(path, *identity)
            os.chmod(path, 0o700)
        os.chown(self.answer, *identity)
        os.chmod(self.answer, 0o600)

    @property
    def box(self) -> Path:
        return self.root / "box"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def newroot(self) -> Path:
        return self.root / "newroot"

    scratch = property(lambda self: self.box / "scratch")
    home = property(lambda self: self.scratch / "home")
    tmp = property(lambda self: self.scratch / "tmp")
    work = property(lambda self: self.scratch / "work")
    answer = property(lambda self: self.box / "answer.json")
    lib = property(lambda self: self.box / "lib")
    code = property(lambda self: self.box / "code")
    run = property(lambda self: self.box / "run")

    def remove(self) -> str | None:
        """Delete the box; None, or what could not be deleted (one line). Iterative, never through a link:
        the child may leave a directory chain deeper than any recursion limit, or directories without
        write permission."""
        left = remove_tree(self.root)
        return None if left is None else f"the probe's scratch {self.root} could not be fully removed ({left})"


def remove_tree(root: Path) -> str | None:
    """rm -rf without recursion or following links; None when all is gone, else the first problem."""
    problem: str | None = None
    stack: list[tuple[str, bool]] = [(str(root), False)]  # (directory, its entries already handled)
    while stack:
        path, expanded = stack.pop()
        if not expanded:
            try:
                os.chmod(path, 0o700, follow_symlinks=False)  # a directory the child made unwritable
            except OSError:
                pass
            try:
                entries = list(os.scandir(path))
            except OSError as exc:
                entries = []
                problem = problem or f"{path}: {exc.strerror or exc}"
            stack.append((path, True))
            for entry in entries:
                try:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append((entry.path, False))
                    else:
                        os.unlink(entry.path)
                except OSError as exc:
                    problem = problem or f"{entry.path}: {exc.strerror or exc}"
            continue
        try:
            os.rmdir(path)
        except OSError as exc:
            problem = problem or f"{path}: {exc.strerror or exc}"
    return problem if os.path.lexists(root) else None


def child_environment(box: Box, python: str, threads: int) -> dict[str, str]:
    """The probe child's whole environment: the allowlist of sleuth's own, then the scratch and offline settings."""
    env = {k: v for k, v in os.environ.items() if k in ENV_PASSTHROUGH or k.startswith("LC_")}
    env.setdefault("LANG", "C.UTF-8")
    home, tmp = str(box.home), str(box.tmp)
    env.update({
        "HOME": home, "TMPDIR": tmp, "TMP": tmp, "TEMP": tmp,
        "XDG_CACHE_HOME": f"{home}/.cache", "XDG_CONFIG_HOME": f"{home}/.config", "XDG_DATA_HOME": f"{home}/.local/share",
        "PATH": os.pathsep.join([os.path.dirname(python), "/usr/local/bin", "/usr/bin", "/bin"]),
        "PYTHONPATH": os.pathsep.join([str(box.lib), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "PYTHONDONTWRITEBYTECODE": "1",
        "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TORCHDYNAMO_DISABLE": "1", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
    })
    return env


# --- the probe interpreter -------------------------------------------------------------------------------

_FACTS_SCRIPT = (
    "import sys, json, importlib.util as u\n"
    "spec = u.find_spec('torch')\n"
    "print(json.dumps({'executable': sys.executable, 'version': sys.version.split()[0],\n"
    "  'prefixes': sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}),\n"
    "  'path': [p for p in sys.path if p], 'torch': spec.origin if spec else None}))\n"
)


@dataclass
class InterpreterFacts:
    executable: str
    version: str
    prefixes: list[str]
    path: list[str]
    torch: str | None  # where `import torch` would load from; None: it would fail


FACTS_TIMEOUT_S = 60.0  # how long the probe interpreter may take to say where it imports from


def interpreter_facts(python: str, env: dict[str, str], cwd: Path, timeout_s: float | None = None) -> InterpreterFacts:
    """Where the probe interpreter imports from (its prefixes and sys.path under the child's environment),
    without importing anything: the directories its read-only view must hold. An interpreter that does not
    answer in time is killed with its whole process group (a wrapper script's children hold its pipes)."""
    timeout_s = FACTS_TIMEOUT_S if timeout_s is None else timeout_s
    try:
        returncode, out, err = run_in_own_group([python, "-c", _FACTS_SCRIPT], env=env, cwd=cwd, timeout=timeout_s)
    except OSError as exc:
        raise SandboxError(f"cannot start {python}: {exc.strerror or exc}") from None
    except subprocess.TimeoutExpired:
        raise SandboxError(f"the probe interpreter {python} did not start within {timeout_s:g} s") from None
    done = subprocess.CompletedProcess([python, "-c", _FACTS_SCRIPT], returncode, out.decode("utf-8", "replace")[-65536:],
                                       err.decode("utf-8", "replace")[-65536:])
    try:
        facts = json.loads(done.stdout.strip().splitlines()[-1])
        return InterpreterFacts(**facts)
    except (ValueError, IndexError, TypeError):
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise SandboxError(f"{python} is not a working Python interpreter ({last[:200]})") from None


# --- the read-only view ----------------------------------------------------------------------------------


def filesystem_ops(read_paths: list[str], box_dir: Path, writable: tuple[Path, ...] = ()) -> list[tuple[str, ...]]:
    """The operations that build the child's root: ("dir", P), ("symlink", P, TARGET), ("bind", P) read-only,
    ("bind_rw", P). Each read path is made reachable as it is on the host: every symlink on the way is
    recreated with its own text and its target followed, so the view holds physical paths only and no
    operation ever resolves through a host symlink. A bind inside another bind is dropped. The box is bound
    read-only, then the `writable` files in it (the answer) read-write: the child's scratch is a tmpfs over
    it (confine.py), so nothing it writes lands on the host's disk but the answer."""
    dirs: set[str] = set()
    links: dict[str, str] = {}
    binds = {physical for path in read_paths if (physical := _reach(os.path.abspath(path), dirs, links))}
    box = _reach(str(box_dir), dirs, links)
    if box is None:
        raise SandboxError(f"the scratch box {box_dir} does not exist")

    def under(path: str, roots: set[str]) -> bool:
        return any(path != root and path.startswith(root.rstrip("/") + "/") for root in roots)

    bound = {b for b in binds if not under(b, binds) and b != box}
    ops: list[tuple[str, ...]] = []
    for path in sorted(dirs, key=_depth):
        if path not in bound and not under(path, bound):
            ops.append(("dir", path))
    for path, target in sorted(links.items(), key=lambda item: _depth(item[0])):
        if not under(path, bound):
            ops.append(("symlink", path, target))
    ops += [("bind", path) for path in sorted(bound, key=_depth)]
    # Last, so that it is there even where a read path holds it (a PYTHONPATH of /tmp).
    ops.append(("bind", box))
    ops += [("bind_rw", os.path.join(box, os.path.relpath(path, box_dir))) for path in writable]
    return ops


def _depth(path: str) -> tuple[int, str]:
    return path.count("/"), path


def _reach(path: str, dirs: set[str], links: dict[str, str]) -> str | None:
    parts = list(Path(path).parts[1:])
    current, index, hops = "/", 0, 0
    while index < len(parts):
        candidate = os.path.join(current, parts[index])
        if os.path.islink(candidate):
            hops += 1
            if hops > 40:
                return None
            target = os.readlink(candidate)
            links[candidate] = target
            resolved = os.path.normpath(os.path.join(current, target))
            parts, current, index = list(Path(resolved).parts[1:]) + parts[index + 1:], "/", 0
            continue
        if not os.path.lexists(candidate):
            return None
        if index < len(parts) - 1:
            dirs.add(candidate)
        current, index = candidate, index + 1
    return current if current != "/" else None


def read_paths_for(facts: InterpreterFacts, python: str) -> list[str]:
    paths = [p for p in SYSTEM_READ_PATHS if os.path.lexists(p)]
    paths += [python, facts.executable, *facts.prefixes]
    paths += [p for p in facts.path if os.path.isabs(p) and os.path.exists(p)]
    return paths


# --- running -----------------------------------------------------------------------------------------------


@dataclass
class Finished:
    """How the child ended, and what sleuth read back of it (bounded)."""

    returncode: int | None
    timed_out: bool
    stdout_tail: str
    stderr_tail: str
    stdout_bytes: int
    stderr_bytes: int
    wall_s: float
    isolation: Isolation
    swept: int = 0  # processes still alive after the child ended, killed by the sweep

    def ending(self, limits: Limits) -> str:
        """One phrase on how it ended, for error messages."""
        if self.timed_out:
            return "it ran past its time limit and was stopped"
        code = self.returncode
        if code is not None and code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
            why = {"SIGXFSZ": f"it wrote a file or output past the {limits.file_size // 2**20} MiB limit",
                   "SIGXCPU": f"it used more than {limits.cpu_seconds} s of CPU time"}.get(name)
            return f"killed by {name}" + (f": {why}" if why else "")
        return f"exit status {code}"


def run_confined(argv: list[str], *, box: Box, env: dict[str, str], read_paths: list[str], timeout_s: float,
                 limits: Limits) -> Finished:
    """Run argv (the probe worker) isolated as strongly as this machine allows; never leaves a process behind."""
    requested = os.environ.get(ISOLATION_ENV, "auto").strip().lower() or "auto"
    if requested != "auto" and requested not in ISOLATION_LEVELS:
        raise SandboxError(f"{ISOLATION_ENV}={requested!r}: expected auto, {', '.join(ISOLATION_LEVELS)}")
    levels = ISOLATION_LEVELS if requested == "auto" else (requested,)
    skipped: list[str] = []
    box.hand_over(child_ids())
    for level in levels:
        unavailable = _unavailable(level)
        if unavailable is not None:
            if requested != "auto":
                raise SandboxError(f"{ISOLATION_ENV}={level}: {unavailable}")
            if level != "process":
                skipped.append(f"{level}: {unavailable}")
            continue
        # Only a weaker level says what it fell back from: bwrap and namespaces isolate alike.
        fallback = ("; ".join(skipped) or None) if level == "process" else None
        try:
            finished = _launch(level, argv, box=box, env=env, read_paths=read_paths, timeout_s=timeout_s,
                               limits=limits, fallback=fallback)
        except SandboxError as exc:
            if requested != "auto" or not skipped:
                raise
            raise SandboxError("no isolation level could start the probe: " + "; ".join([*skipped, f"{level}: {exc}"]))
        if finished is not None:
            return finished
        reason = _FAILED_LEVELS.get(level, "set-up failed")
        if requested != "auto":
            raise SandboxError(f"{ISOLATION_ENV}={level}: {reason}")
        skipped.append(f"{level}: {reason}")
    raise SandboxError("no isolation level could start the probe: " + "; ".join(skipped))


def _planned() -> str | None:
    requested = os.environ.get(ISOLATION_ENV, "auto").strip().lower() or "auto"
    for level in (ISOLATION_LEVELS if requested == "auto" else (requested,)):
        if _unavailable(level) is None:
            return level
    return None


def planned_level() -> str:
    """The level the next probe will get (unless its set-up fails), in words, for the consent message."""
    level = _planned()
    if level is None:
        return f"none available ({os.environ.get(ISOLATION_ENV, 'auto')})"
    if level == "process":
        return ("process only (no namespaces on this machine: the code can reach the network and your "
                "files; scratch HOME, no secrets in its environment, limits, killed at the end)")
    return f"{level} (no network, read-only view without your home or the run, own PID namespace, no privileges)"


def weak_isolation_warning() -> str | None:
    """What the user must hear before code runs at the process level; None where namespaces isolate it."""
    if _planned() != "process":
        return None
    return ("this machine allows only process-level isolation: the code can reach the network and your files")


def _unavailable(level: str) -> str | None:
    if level in _FAILED_LEVELS:
        return _FAILED_LEVELS[level]
    if level == "process":
        return None if os.name == "posix" else "probes need a POSIX system"
    if sys.platform != "linux":
        return "Linux namespaces only"
    if level == "bwrap":
        if os.geteuid() == 0:
            # bwrap run by root keeps the child host uid 0 (its --uid maps onto the caller's): root-owned files
            # and host-global sysctls answer to that. sleuth's own set-up makes the child nobody.
            return "sleuth is root: the namespaces level runs the child as nobody, bwrap would keep it root"
        return None if shutil.which("bwrap") else "bubblewrap (bwrap) is not installed"
    if not shutil.which("unshare"):
        return "util-linux unshare is not installed"
    if os.geteuid() != 0 and not _user_namespaces_enabled():
        return "not root and unprivileged user namespaces are disabled"
    return None


def _user_namespaces_enabled() -> bool:
    for knob, off in (("/proc/sys/user/max_user_namespaces", "0"), ("/proc/sys/kernel/unprivileged_userns_clone", "0")):
        try:
            if Path(knob).read_text().strip() == off:
                return False
        except OSError:
            continue
    return True


def _launch(level: str, argv: list[str], *, box: Box, env: dict[str, str], read_paths: list[str],
            timeout_s: float, limits: Limits, fallback: str | None) -> Finished | None:
    """One attempt at `level`; None when the isolation itself could not be set up (nothing of the subject ran)."""
    marker_path = box.logs / f"marker-{level}"
    marker_fd = os.open(marker_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    pass_fds: tuple[int, ...] = ()
    identity = child_ids()
    try:
        if level == "process":
            unreachable = _unreachable_for(identity, [*read_paths, str(box.work)]) if identity is not None else None
            if unreachable is not None:
                raise SandboxError(f"at the process level a root sleuth runs the probe as uid {identity[0]}, which "
                                   f"cannot read {unreachable}: give --probe-python an interpreter others can read, "
                                   "or run where namespaces are available")
            command, pass_fds = argv, ()
        elif level == "bwrap":
            command, pass_fds = _bwrap_command(argv, box, read_paths, marker_fd, limits), (marker_fd,)
        else:
            plan = {"new_root": str(box.newroot), "ops": filesystem_ops(read_paths, box.box, (box.answer,)),
                    "cwd": str(box.work), "argv": argv, "marker_fd": marker_fd, "become": identity,
                    "scratch": [{"path": str(box.scratch), "bytes": limits.scratch_bytes, "owner": identity,
                                 "folders": ["home", "tmp", "work"]}]}
            plan_path = box.logs / "confine.json"
            plan_path.write_text(json.dumps(plan))
            command, pass_fds = _unshare_command(plan_path), (marker_fd,)
        finished = _spawn(command, level, box=box, env=env, timeout_s=timeout_s, limits=limits,
                          pass_fds=pass_fds, fallback=fallback)
    finally:
        os.close(marker_fd)
    if level != "process" and marker_path.stat().st_size == 0:
        # The set-up failed before the worker started: say why (the set-up's own message) and try the next level.
        _FAILED_LEVELS[level] = (finished.stderr_tail.strip().splitlines() or [finished.ending(limits)])[-1][:300]
        return None
    if level == "namespaces":
        try:
            got = json.loads(marker_path.read_bytes()[:4096])
        except ValueError:
            got = {}
        finished.isolation = describe_level(level, limits, fallback, got if isinstance(got, dict) else {})
    return finished


def _unreachable_for(identity: tuple[int, int], paths: list[str]) -> str | None:
    """The first of `paths` (or a directory on the way to one, links followed) that uid/gid `identity`, with
    no supplementary groups, may not read and search; None when it reaches all of them."""
    uid, gid = identity

    def allowed(info: os.stat_result, want: int) -> bool:  # want: 4 read, 1 search/execute
        if info.st_uid == uid:
            bits = info.st_mode >> 6
        elif info.st_gid == gid:
            bits = info.st_mode >> 3
        else:
            bits = info.st_mode
        return bits & want == want

    for path in paths:
        for candidate in dict.fromkeys([os.path.abspath(path), os.path.realpath(path)]):
            parts = Path(candidate).parts
            for depth in range(1, len(parts)):
                folder = os.path.join(*parts[:depth])
                try:
                    if not allowed(os.stat(folder), 1):
                        return folder
                except OSError:
                    return folder
            try:
                info = os.stat(candidate)
            except OSError:
                return candidate
            if not allowed(info, 4 | (1 if stat.S_ISDIR(info.st_mode) else 0)):
                return candidate
    return None


def _unshare_command(plan_path: Path) -> list[str]:
    # As root no --user here: the mounts need the host's root (to bind paths only root may pass through);
    # confine.py then becomes nobody and enters a user namespace of the child's own.
    command = [shutil.which("unshare") or "unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork",
               "--kill-child"]
    if os.geteuid() != 0:
        command += ["--user", "--map-root-user"]
    return [*command, "--", sys.executable, "-I", "-S", str(CONFINE), "root", str(plan_path)]


def _bwrap_command(argv: list[str], box: Box, read_paths: list[str], marker_fd: int,
                   limits: Limits | None = None) -> list[str]:
    limits = limits or Limits()
    command = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
               "--cap-drop", "ALL", "--hostname", "sleuth-probe"]
    for op in filesystem_ops(read_paths, box.box, (box.answer,)):
        if op[0] == "dir":
            command += ["--dir", op[1]]
        elif op[0] == "symlink":
            command += ["--symlink", op[2], op[1]]
        else:
            command += ["--bind" if op[0] == "bind_rw" else "--ro-bind", op[1], op[1]]
    command += ["--size", str(limits.scratch_bytes), "--tmpfs", str(box.scratch)]
    for folder in (box.home, box.tmp, box.work):
        command += ["--dir", str(folder)]
    # The root bwrap builds is a tmpfs: read-only once the binds are in, as confine.py leaves its own.
    command += ["--dev", "/dev", "--proc", "/proc", "--remount-ro", "/", "--chdir", str(box.work),
                "--info-fd", str(marker_fd)]
    # The worker through confine.py's copy in the box (the view holds no other): a fresh session keyring first.
    confine = box.lib / "sleuth" / "probes" / CONFINE.name
    return [*command, "--", argv[0], "-I", "-S", str(confine), "keyring", "--", *argv]


def _spawn(command: list[str], level: str, *, box: Box, env: dict[str, str], timeout_s: float, limits: Limits,
           pass_fds: tuple[int, ...], fallback: str | None) -> Finished:
    stdout_path, stderr_path = box.logs / f"stdout-{level}", box.logs / f"stderr-{level}"
    process_level = level == "process"
    before = _children() if process_level else set()
    if process_level:
        _set_subreaper(True)  # orphans that leave the session come back to sleuth, to be swept
        # A child of sleuth's uid could read sleuth's /proc/PID/environ (tokens) and memory: sleuth is
        # not dumpable from here on (it stays so: more probes may follow, and sleuth needs no core dump).
        if _libc is not None:
            _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    started = time.perf_counter()
    timed_out = False
    try:
        with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err:
            try:
                process = subprocess.Popen(_with_limits(command, limits, drop_privileges=process_level),
                                           stdin=subprocess.DEVNULL, stdout=out,
                                           stderr=err, cwd=box.work, env=env, pass_fds=pass_fds,
                                           start_new_session=True)
            except OSError as exc:
                err.write(f"cannot start {command[0]}: {exc.strerror or exc}\n".encode())
                process = None
            if process is not None:
                with _LOCK:
                    _LIVE.add(process.pid)
                try:
                    process.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:  # an interrupt too: nothing of the probe outlives this call
                    swept = _end_session(process, before, adopt_orphans=process_level)
                    with _LOCK:
                        _LIVE.discard(process.pid)
                returncode = None if timed_out else process.returncode
            else:
                swept, returncode = 0, 127
    finally:
        if process_level:
            _set_subreaper(False)
    return Finished(returncode=returncode, timed_out=timed_out, stdout_tail=_tail(stdout_path),
                    stderr_tail=_tail(stderr_path), stdout_bytes=stdout_path.stat().st_size,
                    stderr_bytes=stderr_path.stat().st_size, wall_s=round(time.perf_counter() - started, 3),
                    isolation=describe_level(level, limits, fallback), swept=swept)


def _with_limits(command: list[str], limits: Limits, *, drop_privileges: bool) -> list[str]:
    """command, started through confine.py's limits step (see there why not a preexec_fn)."""
    identity = child_ids()
    values: dict[str, Any] = {
        "as": limits.address_space, "cpu": limits.cpu_seconds, "fsize": limits.file_size,
        "nofile": limits.open_files, "core": 0,
        # RLIMIT_NPROC counts every task of the child's uid (the user's, or nobody's when sleuth is root: the
        # kernel applies it from the uid change on), so the limit sits on top of what that uid runs now.
        "nproc": _user_tasks(identity[0] if identity else os.getuid()) + limits.processes,
        # The namespace levels drop privileges inside (unshare and bwrap need them to set up).
        "drop_privileges": drop_privileges,
        # The process level as root: the child becomes nobody here (the namespace level does it inside).
        "become": identity if drop_privileges else None,
    }
    return [sys.executable, "-I", "-S", str(CONFINE), "limits", json.dumps(values), "--", *command]


def _end_session(process: subprocess.Popen, before: set[int], *, adopt_orphans: bool) -> int:
    """Kill the child's session and everything that left it; the number of processes that had to be swept.
    With `adopt_orphans` (the process level, sleuth a subreaper meanwhile) sleuth's own new children are
    strays too: they are the probe's orphans, whichever session they moved to."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    swept = 0
    for _ in range(50):  # orphans reparent to sleuth one generation at a time
        stray = {pid for pid, (ppid, sid, pgid) in _process_table().items()
                 if sid == process.pid or pgid == process.pid
                 or (adopt_orphans and ppid == os.getpid() and pid not in before)}
        stray.discard(process.pid)
        with _LOCK:
            stray -= _LIVE
        if not stray:
            break
        for pid in stray:
            try:
                os.kill(pid, signal.SIGKILL)
                swept += 1
            except (ProcessLookupError, PermissionError):
                pass
        for pid in stray:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass  # not ours: its own parent reaps it
        time.sleep(0.01)
    if adopt_orphans:  # orphans that had already exited came back as zombies: reap them (no process is left)
        me = os.getpid()
        for pid, (ppid, _sid, _pgid) in _process_table(zombies=True).items():
            if ppid == me and pid not in before and pid != process.pid:
                with _LOCK:
                    if pid in _LIVE:
                        continue
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
    return swept


def _process_table(*, zombies: bool = False) -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, session, process group) for every process visible in /proc (zombies only if asked)."""
    table: dict[int, tuple[int, int, int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                raw = handle.read()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2:].split()
        if fields[0] == b"Z" and not zombies:
            continue
        table[int(entry.name)] = (int(fields[1]), int(fields[3]), int(fields[2]))
    return table


def _children() -> set[int]:
    me = os.getpid()
    return {pid for pid, (ppid, _sid, _pgid) in _process_table().items() if ppid == me}


def _user_tasks(uid: int) -> int:
    """Tasks (threads included) `uid` runs now: RLIMIT_NPROC counts them all, so the limit is on top."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/status", encoding="ascii", errors="replace") as handle:
                status = dict(line.split(":", 1) for line in handle if ":" in line)
        except OSError:
            continue
        if int(status.get("Uid", "-1").split()[0]) == uid:
            total += int(status.get("Threads", "1").strip() or 1)
    return total


def _set_subreaper(on: bool) -> None:
    with _LOCK:
        _REAPING[0] += 1 if on else -1
        if _libc is not None:
            _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1 if _REAPING[0] > 0 else 0, 0, 0, 0)


def _tail(path: Path) -> str:
    with open(path, "rb") as handle:
        handle.seek(max(0, os.fstat(handle.fileno()).st_size - TAIL_BYTES))
        return handle.read(TAIL_BYTES).decode("utf-8", errors="replace")


__all__ = ["ISOLATION_ENV", "ISOLATION_LEVELS", "Box", "Finished", "InterpreterFacts", "Isolation", "Limits",
           "SandboxError", "child_environment", "child_ids", "describe_level", "filesystem_ops", "interpreter_facts",
           "planned_level", "read_paths_for", "remove_tree", "run_confined", "weak_isolation_warning"]
