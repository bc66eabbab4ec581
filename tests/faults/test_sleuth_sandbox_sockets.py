"""The probe sandbox exposes no socket or device of the host: listeners outside the box, of every kind, are
unreachable from probed code. Real listeners: a filesystem unix socket in a folder the child's view must
show (a PYTHONPATH entry: bound read-only, and connect() needs no write access to the mount), one in the
test's own folder, one in HOME, an abstract unix socket, TCP on 127.0.0.1; and a datagram socket, which a
`socketpair` datagram end could reach by sendto(). Each listener counts what reaches it; the child says
what each attempt gave. Skipped where the machine gives probes no namespaces (the process level is
documented as reaching both the network and the user's files).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from sleuth.probes.sandbox import (
    Box,
    Limits,
    child_environment,
    interpreter_facts,
    planned_level,
    read_paths_for,
    run_confined,
)

pytestmark = pytest.mark.skipif(planned_level().startswith("process"),
                                reason="this machine gives probes no namespaces (process level)")

ATTEMPTS = r'''
import json, os, socket, sys
targets = json.loads(sys.argv[1])
said = {}
for name, (family, kind, address) in targets.items():
    try:
        s = socket.socket(getattr(socket, family), getattr(socket, kind))
        s.settimeout(2)
        if kind == "SOCK_DGRAM":
            s.sendto(b"x", address if isinstance(address, str) else tuple(address))
        else:
            s.connect(address if isinstance(address, str) else tuple(address))
        said[name] = "reached"
    except OSError as exc:
        said[name] = f"refused: {exc.strerror or exc}"
try:  # a datagram socketpair end can address any path with sendto()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    a.sendto(b"x", targets["dgram_in_view"][2])
    said["socketpair_dgram"] = "reached"
except OSError as exc:
    said["socketpair_dgram"] = f"refused: {exc.strerror or exc}"
try:  # what multiprocessing's pipes use still works
    a, b = socket.socketpair()
    a.send(b"ok")
    said["socketpair_stream"] = b.recv(2).decode()
except OSError as exc:
    said["socketpair_stream"] = f"refused: {exc.strerror or exc}"
print(json.dumps(said))
'''


class Listener:
    def __init__(self, family: int, kind: int, address) -> None:
        self.sock = socket.socket(family, kind)
        self.sock.bind(address)
        if family == socket.AF_UNIX and not address.startswith("\0"):
            os.chmod(address, 0o777)  # anyone may connect: only the sandbox stands between
        if kind == socket.SOCK_STREAM:
            self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.address = self.sock.getsockname()
        self.reached = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(kind,), daemon=True)
        self.thread.start()

    def _serve(self, kind: int) -> None:
        while not self.stopping.is_set():
            try:
                if kind == socket.SOCK_STREAM:
                    conn, _ = self.sock.accept()
                    conn.close()
                else:
                    self.sock.recv(64)
                self.reached += 1
            except OSError:
                continue

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=2)
        self.sock.close()


def test_no_listener_outside_the_box_is_reachable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    in_view = Path(f"/tmp/sleuth-view-{os.getpid()}")  # short: a unix socket path has 108 bytes at most
    in_view.mkdir(exist_ok=True)
    home = tmp_path / "home"
    home.mkdir()
    listeners = {
        "fs_in_view": Listener(socket.AF_UNIX, socket.SOCK_STREAM, str(in_view / "s")),
        "dgram_in_view": Listener(socket.AF_UNIX, socket.SOCK_DGRAM, str(in_view / "d")),
        "fs_in_tmp": Listener(socket.AF_UNIX, socket.SOCK_STREAM, str(tmp_path / "s")),
        "fs_in_home": Listener(socket.AF_UNIX, socket.SOCK_STREAM, str(home / "s")),
        "abstract": Listener(socket.AF_UNIX, socket.SOCK_STREAM, f"\0sleuth-abstract-{os.getpid()}"),
        "tcp": Listener(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", 0)),
    }
    targets = {name: ("AF_INET" if name == "tcp" else "AF_UNIX",
                      "SOCK_DGRAM" if name.startswith("dgram") else "SOCK_STREAM",
                      listener.address.decode("latin-1") if isinstance(listener.address, bytes)
                      else listener.address)
               for name, listener in listeners.items()}
    monkeypatch.setenv("HOME", str(home))
    # The folder holding the first two listeners is on the child's PYTHONPATH: its view must show it.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(in_view), os.environ.get("PYTHONPATH")])))
    box = Box.create()
    try:
        (box.lib / "attempts.py").write_text(ATTEMPTS)
        env = child_environment(box, sys.executable, 1)
        assert str(in_view) in env["PYTHONPATH"]
        facts = interpreter_facts(sys.executable, env, box.work)
        read_paths = read_paths_for(facts, sys.executable)
        assert any(str(in_view) == os.path.realpath(p) for p in read_paths)
        finished = run_confined([sys.executable, str(box.lib / "attempts.py"), json.dumps(targets)], box=box,
                                env=env, read_paths=read_paths, timeout_s=60, limits=Limits())
        time.sleep(0.3)  # a connection still in flight
    finally:
        box.remove()
        for listener in listeners.values():
            listener.close()
        for name in ("s", "d"):
            (in_view / name).unlink(missing_ok=True)
        in_view.rmdir()
    assert finished.returncode == 0, finished.stderr_tail
    said = json.loads(finished.stdout_tail.strip().splitlines()[-1])
    reached = {name: listener.reached for name, listener in listeners.items() if listener.reached}
    assert reached == {}, (reached, said)
    assert all(said[name].startswith("refused") for name in [*listeners, "socketpair_dgram"]), said
    assert said["socketpair_stream"] == "ok"  # a probe's own pipes keep working
    assert "unix sockets: refused" in finished.isolation.network
