"""The probe child's trusted first steps, run by sleuth's own interpreter (standard library only) before any
code under diagnosis exists in the process. Two of them:

    <python> -I -S confine.py limits LIMITS_JSON -- COMMAND...
        set the resource limits and "die with sleuth" (PR_SET_PDEATHSIG), then exec COMMAND: the first
        link of every probe child, so the limits hold for everything it starts (done here rather than in
        a preexec_fn, which is unsafe when sleuth probes from several threads); at the process level it
        also drops every capability (a root sleuth's child keeps no privilege);
        at the process level, when sleuth is root, it also becomes the unprivileged child user (nobody): a
        child with sleuth's own uid could signal sleuth, read its memory or write the user's files;
    unshare --mount --net --pid --ipc --uts --fork --kill-child [--user --map-root-user] -- \\
        <python> -I -S confine.py root PLAN.json
        inside fresh namespaces: build the file system view, become the unprivileged child user in a user
        namespace of its own, drop every privilege, then exec the worker;
    bwrap ... -- <python> -I -S <box>/lib/sleuth/probes/confine.py keyring -- COMMAND...
        inside bubblewrap (which does the rest): a fresh session keyring, then exec COMMAND.

PLAN.json (written by sandbox.py) lists the operations that make the new root: directories and
symlinks on a small tmpfs, the read-only binds (the system, the probe interpreter and its sys.path), the
one writable bind (the scratch box), /dev with the harmless devices, a fresh /proc for the new PID
namespace, with the host-global parts of it (/proc/sys, /proc/sysrq-trigger, ...) bound read-only over it,
as bubblewrap does. Then pivot_root into it (the old root is detached: no path leads back), remount
everything read-only but the box, and take away what a root-owned process would still hold:
  * the uid: when sleuth is root, the child becomes PLAN's unprivileged uid/gid (nobody), then enters a
    user namespace of its own mapping only that uid. A process that is global uid 0 writes every
    host-global sysctl whose file mode allows root (core_pattern: a command run as root on the next
    crash), capabilities or not; nobody writes none of them;
  * the kernel keyrings: a fresh session keyring, and (in the fresh user namespace) a fresh user keyring,
    so the user's Kerberos / fscrypt keys are neither readable nor left with keys of the child's;
  * the capability bounding set and every capability, then no_new_privs;
  * every unix socket of the host: a seccomp filter refuses creating an AF_UNIX socket (and a datagram
    socketpair, and an io_uring), since a socket file in a folder the view must show stays connectable
    through a read-only bind (abstract sockets and TCP belong to the empty network namespace already).
    Inside bubblewrap the `keyring` step installs the same filter.
A JSON line on the marker descriptor says the set-up succeeded and what it got (sleuth falls back to weaker
isolation only when nothing was written: code under diagnosis never runs before the marker, so it cannot
force a fallback).
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 38, 24, 47, 4
PR_SET_DUMPABLE = 4
CLONE_NEWUSER = 0x10000000
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_CAPSET = {"x86_64": 126, "aarch64": 91, "arm64": 91, "riscv64": 91, "ppc64le": 184, "s390x": 185}
_KEYCTL = {"x86_64": 250, "aarch64": 219, "arm64": 219, "riscv64": 219, "ppc64le": 271, "s390x": 280}
KEYCTL_JOIN_SESSION_KEYRING = 1
DEVICES = ("null", "zero", "full", "random", "urandom")
# The parts of a fresh procfs that are global to the host whatever namespace reads them: read-only in the
# view (bubblewrap's list).
PROC_READ_ONLY = ("sys", "sysrq-trigger", "irq", "bus", "fs")

# The interpreter itself links libc: its symbols are at hand without a (slow) find_library.
libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(libc.mount(source and source.encode(), target.encode(), fstype and fstype.encode(),
                      ctypes.c_ulong(flags), data and data.encode()), f"mount {source or fstype} on {target}")


def bind(source: str, target: str, *, writable: bool, device: bool = False) -> None:
    mount(source, target, None, MS_BIND)
    flags = MS_REMOUNT | MS_BIND | MS_NOSUID | (0 if device else MS_NODEV) | (0 if writable else MS_RDONLY)
    mount(None, target, None, flags)


def build_root(plan: dict) -> None:
    new_root = plan["new_root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates back to the host
    mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=16m")

    def inside(path: str) -> str:
        return new_root + path

    for op in plan["ops"]:
        kind, path = op[0], op[1]
        if kind == "dir":
            os.makedirs(inside(path), mode=0o755, exist_ok=True)
        elif kind == "symlink":
            os.symlink(op[2], inside(path))
        elif kind in ("bind", "bind_rw"):
            if os.path.isdir(path):
                os.makedirs(inside(path), mode=0o755, exist_ok=True)
            elif not os.path.lexists(inside(path)):  # (the answer file is there already, in the read-only box)
                os.makedirs(os.path.dirname(inside(path)), mode=0o755, exist_ok=True)
                open(inside(path), "a").close()
            bind(path, inside(path), writable=kind == "bind_rw")
    os.makedirs(inside("/dev/shm"), exist_ok=True)
    for device in DEVICES:
        if not os.path.exists(f"/dev/{device}"):  # a minimal container may lack one (/dev/full)
            continue
        open(inside(f"/dev/{device}"), "a").close()
        bind(f"/dev/{device}", inside(f"/dev/{device}"), writable=True, device=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, inside(f"/dev/{name}"))
    mount("tmpfs", inside("/dev/shm"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=64m")
    os.makedirs(inside("/proc"), exist_ok=True)
    mount("proc", inside("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for name in PROC_READ_ONLY:
        path = inside(f"/proc/{name}")
        if os.path.lexists(path):
            mount(path, path, None, MS_BIND | MS_REC)
            mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for size_op in plan.get("scratch", []):  # the child's writable scratch: a size-capped tmpfs, not the disk
        path, size, owner = inside(size_op["path"]), int(size_op["bytes"]), size_op.get("owner")
        options = f"mode=0700,size={size}" + (f",uid={owner[0]},gid={owner[1]}" if owner else "")
        mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, options)
        for folder in size_op.get("folders", []):
            os.mkdir(os.path.join(path, folder), 0o700)
            if owner:
                os.chown(os.path.join(path, folder), owner[0], owner[1])

    os.chdir(new_root)
    os.makedirs(".old-root", exist_ok=True)
    number = _PIVOT_ROOT.get(platform.machine())
    if number is not None and libc.syscall(number, b".", b".old-root") == 0:
        os.chdir("/")
        _check(libc.umount2(b"/.old-root", MNT_DETACH), "detach the old root")
        os.rmdir("/.old-root")
    else:  # an architecture without a known pivot_root number: chroot, safe once CAP_SYS_CHROOT is gone
        os.chroot(".")
        os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def become(uid: int, gid: int) -> None:
    """Global root becomes the unprivileged child user for good (real, effective and saved ids, no groups)."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    # A uid change makes the process non-dumpable, which leaves /proc/self root's: its own uid_map included.
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)


def enter_user_namespace() -> str | None:
    """A user namespace of the child's own mapping only its uid and gid (fresh user keyrings, no privilege
    over anything of the host's); None on success, else why not (user namespaces disabled)."""
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER) != 0:
        return os.strerror(ctypes.get_errno())
    for name, text in (("uid_map", f"{uid} {uid} 1\n"), ("setgroups", "deny"), ("gid_map", f"{gid} {gid} 1\n")):
        with open(f"/proc/self/{name}", "w") as handle:
            handle.write(text)
    return None


def new_session_keyring() -> str | None:
    """Leave the user's session keyring for a fresh, empty one; None on success, else why not."""
    number = _KEYCTL.get(platform.machine())
    if number is None:
        return f"no keyctl number known for {platform.machine()}"
    if libc.syscall(number, KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        return os.strerror(ctypes.get_errno())
    return None


def drop_privileges() -> None:
    for capability in range(64):
        libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0)  # EINVAL past the last capability: ignored
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    number = _CAPSET.get(platform.machine())
    if number is not None:
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
        data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (x2 words): all empty
        _check(libc.syscall(number, header, data), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


# The seccomp filter that keeps the child off every unix socket of the host. A socket file in a folder the view
# must show (a PYTHONPATH entry, the interpreter's prefix) is reachable through a read-only bind: connect()
# needs no write access to the mount. Abstract sockets and TCP belong to the network namespace, which is
# empty; pathname sockets do not, so the child may not create an AF_UNIX socket at all (a connected
# socketpair, which multiprocessing's pipes use, stays allowed, except the datagram kind, which can
# sendto() any path), nor an io_uring (whose IORING_OP_SOCKET creates sockets without the socket syscall).
AF_UNIX, SOCK_DGRAM, SOCK_TYPE_MASK = 1, 2, 0xF
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
EACCES, ENOSYS = 13, 38
# machine: (AUDIT_ARCH, socket, socketpair, io_uring_setup, lowest number of a foreign ABI to refuse or None);
# little-endian only: the filter reads the low half of a 64-bit argument at offset 16 + 8 * index.
_SECCOMP_ARCH = {
    "x86_64": (0xC000003E, 41, 53, 425, 0x40000000),  # x32 system calls (bit 30) refused outright
    "aarch64": (0xC00000B7, 198, 199, 425, None),
    "arm64": (0xC00000B7, 198, 199, 425, None),
    "riscv64": (0xC00000F3, 198, 199, 425, None),
}


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _assemble(program: list) -> list[tuple[int, int, int, int]]:
    """Classic BPF from (op, k, jump-if-true label, jump-if-false label) tuples and "label:" strings."""
    ops = {"ld": 0x20, "jeq": 0x15, "jge": 0x35, "and": 0x54, "ret": 0x06}
    labels, index = {}, 0
    for item in program:
        if isinstance(item, str):
            labels[item.rstrip(":")] = index
        else:
            index += 1
    out, index = [], 0
    for item in program:
        if isinstance(item, str):
            continue
        op, k, *jumps = item
        jt, jf = [(labels[j] - index - 1) if j else 0 for j in (jumps + [None, None])[:2]]
        out.append((ops[op], jt, jf, k))
        index += 1
    return out


def refuse_unix_sockets() -> str:
    """Install the filter (no_new_privs must be set); what the child got, in words."""
    arch = _SECCOMP_ARCH.get(platform.machine())
    if arch is None:
        return f"not refused (no seccomp filter known for {platform.machine()})"
    audit_arch, nr_socket, nr_socketpair, nr_io_uring, foreign_abi = arch
    refuse, missing = SECCOMP_RET_ERRNO | EACCES, SECCOMP_RET_ERRNO | ENOSYS
    program: list = [("ld", 4), ("jeq", audit_arch, None, "missing"), ("ld", 0)]
    if foreign_abi is not None:
        program.append(("jge", foreign_abi, "missing", None))
    program += [("jeq", nr_socket, "socket", None), ("jeq", nr_socketpair, "socketpair", None),
                ("jeq", nr_io_uring, "missing", None), ("ret", SECCOMP_RET_ALLOW),
                "socket:", ("ld", 16), ("jeq", AF_UNIX, "refuse", None), ("ret", SECCOMP_RET_ALLOW),
                "socketpair:", ("ld", 16), ("jeq", AF_UNIX, None, "allow"), ("ld", 24), ("and", SOCK_TYPE_MASK),
                ("jeq", SOCK_DGRAM, "refuse", None), "allow:", ("ret", SECCOMP_RET_ALLOW),
                "refuse:", ("ret", refuse), "missing:", ("ret", missing)]
    code = _assemble(program)
    filters = (_SockFilter * len(code))(*[_SockFilter(*op) for op in code])
    fprog = _SockFprog(len(code), filters)
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")
    return "refused (seccomp: no AF_UNIX socket)"


def apply_limits(limits: dict) -> None:
    import resource
    import signal

    drop = limits.pop("drop_privileges", False)
    identity = limits.pop("become", None)
    for name, value in limits.items():
        if value is not None:
            resource.setrlimit(getattr(resource, f"RLIMIT_{name.upper()}"), (int(value), int(value)))
    if identity is not None:  # the process level as root: the child is not sleuth's uid
        become(int(identity[0]), int(identity[1]))
        new_session_keyring()
    # After the uid change, which clears it: the child dies with the process that started it.
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if drop:  # no namespaces to do it in (the process level): at least no capabilities, even for root
        drop_privileges()


def main(argv: list[str]) -> int:
    step, argv = argv[0], argv[1:]
    if step == "keyring":  # inside bubblewrap, which leaves the user's session keyring attached
        # Where keyctl itself is refused (a seccomp filter), the child cannot reach any keyring either.
        new_session_keyring()
        try:  # bubblewrap has set no_new_privs already
            refuse_unix_sockets()
        except OSError as exc:
            print(f"sleuth-confine: cannot isolate the probe: {exc}", file=sys.stderr)
            return 125
        command = argv[1:]  # after "--"
        try:
            os.execv(command[0], command)
        except OSError as exc:
            print(f"sleuth-confine: cannot start {command[0]}: {exc.strerror or exc}", file=sys.stderr)
            return 127
    if step == "limits":
        try:
            apply_limits(json.loads(argv[0]))
        except (OSError, ValueError) as exc:
            print(f"sleuth-confine: cannot set the probe's limits: {exc}", file=sys.stderr)
            return 125
        command = argv[2:]  # after "--"
        try:
            os.execv(command[0], command)
        except OSError as exc:
            print(f"sleuth-confine: cannot start {command[0]}: {exc.strerror or exc}", file=sys.stderr)
            return 127
    with open(argv[0], encoding="utf-8") as handle:
        plan = json.load(handle)
    got: dict = {"uid": None, "user_namespace": None, "session_keyring": None}
    try:
        build_root(plan)
        identity = plan.get("become")
        if identity is not None:  # sleuth is root: the child is nobody, in a user namespace of its own
            become(int(identity[0]), int(identity[1]))
            problem = enter_user_namespace()
            got["user_namespace"] = "own" if problem is None else f"none ({problem}): global uid {identity[0]}"
        else:  # unshare --user made one already, mapping the user's own uid
            got["user_namespace"] = "own"
        problem = new_session_keyring()
        got["session_keyring"] = "fresh" if problem is None else f"the user's ({problem})"
        got["uid"] = os.getuid()
        drop_privileges()
        got["unix_sockets"] = refuse_unix_sockets()
        os.chdir(plan["cwd"])
    except OSError as exc:
        print(f"sleuth-confine: cannot isolate the probe: {exc}", file=sys.stderr)
        return 125
    marker = int(plan["marker_fd"])
    os.write(marker, json.dumps(got).encode())
    os.close(marker)
    command = plan["argv"]
    try:
        os.execv(command[0], command)
    except OSError as exc:
        print(f"sleuth-confine: cannot start {command[0]} inside the sandbox: {exc.strerror or exc}", file=sys.stderr)
        return 127
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
