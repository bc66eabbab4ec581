"""The probe child's trusted first steps, run by sleuth's own interpreter (standard library only) before any
code under diagnosis exists in the process. Two of them:

    <python> -I -S confine.py limits LIMITS_JSON -- COMMAND...
        set the resource limits and "die with sleuth" (PR_SET_PDEATHSIG), then exec COMMAND: the first
        link of every probe child, so the limits hold for everything it starts (done here rather than in
        a preexec_fn, which is unsafe when sleuth probes from several threads); at the process level it
        also drops every capability (a root sleuth's child keeps no privilege);
    unshare --mount --net --pid --ipc --uts --fork --kill-child [--user --map-root-user] -- \\
        <python> -I -S confine.py root PLAN.json
        inside fresh namespaces: build the file system view, drop every privilege, then exec the worker.

PLAN.json (written by sandbox.py) lists the operations that make the new root: directories and
symlinks on a small tmpfs, the read-only binds (the system, the probe interpreter and its sys.path), the
one writable bind (the scratch box), /dev with the harmless devices, a fresh /proc for the new PID
namespace. Then pivot_root into it (the old root is detached: no path leads back), remount everything
read-only but the box, drop the capability bounding set and every capability, set no_new_privs, and exec.
One byte on the marker descriptor says the set-up succeeded (sleuth falls back to weaker isolation only
when it did not: code under diagnosis never runs before the marker, so it cannot force a fallback).
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
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
_CAPSET = {"x86_64": 126, "aarch64": 91, "arm64": 91, "riscv64": 91, "ppc64le": 184, "s390x": 185}
DEVICES = ("null", "zero", "full", "random", "urandom")

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
            else:
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


def apply_limits(limits: dict) -> None:
    import resource
    import signal

    drop = limits.pop("drop_privileges", False)
    for name, value in limits.items():
        if value is not None:
            resource.setrlimit(getattr(resource, f"RLIMIT_{name.upper()}"), (int(value), int(value)))
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if drop:  # no namespaces to do it in (the process level): at least no capabilities, even for root
        drop_privileges()


def main(argv: list[str]) -> int:
    step, argv = argv[0], argv[1:]
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
    try:
        build_root(plan)
        drop_privileges()
        os.chdir(plan["cwd"])
    except OSError as exc:
        print(f"sleuth-confine: cannot isolate the probe: {exc}", file=sys.stderr)
        return 125
    marker = int(plan["marker_fd"])
    os.write(marker, b"1")
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
