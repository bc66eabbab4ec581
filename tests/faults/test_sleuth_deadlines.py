"""Deadlines that hold against a peer that answers, but never finishes: a real server on 127.0.0.1 that drips
its status line or its headers a byte at a time, or sends `100 Continue` forever (each read returns in time,
so no per-read timeout ever fires), and a probe interpreter that never answers. The whole exchange ends
within the tier's deadline plus a small slack, and nothing is left running.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from sleuth.reference import http
from sleuth.reference.http import FetchFailure, HttpPolicy

DEADLINE_S = 2.0
SLACK_S = 1.0
STALL_S = 8.0  # how long a server stalls before it gives up itself: a broken deadline fails, never hangs


class StallingServer:
    """A raw TCP server: whatever the request, `behaviour` writes to the socket until the server stops."""

    def __init__(self, behaviour) -> None:
        self.behaviour = behaviour
        self.stopping = threading.Event()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            conn.recv(65536)  # the request (a CONNECT through the proxy, or a GET)
            self.behaviour(conn, self.stopping)
        except OSError:
            pass  # the client gave up: what the tests expect
        finally:
            conn.close()

    def __enter__(self) -> StallingServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=5)
        self.sock.close()


def _drip(data: bytes, stopping: threading.Event, conn: socket.socket, every_s: float = 0.1) -> None:
    until = time.monotonic() + STALL_S
    for byte in data:
        if stopping.is_set() or time.monotonic() > until:
            return
        conn.sendall(bytes([byte]))
        time.sleep(every_s)


def drip_status_line(conn: socket.socket, stopping: threading.Event) -> None:
    _drip(b"HTTP/1.1 200 OK, eventually" + b" " * 10_000, stopping, conn)


def drip_headers(conn: socket.socket, stopping: threading.Event) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    _drip(b"X-Slow: " + b"a" * 10_000, stopping, conn)


def flood_1xx(conn: socket.socket, stopping: threading.Event) -> None:
    until = time.monotonic() + STALL_S
    while not stopping.is_set() and time.monotonic() < until:
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        time.sleep(0.02)


@pytest.mark.parametrize("behaviour", [drip_status_line, drip_headers, flood_1xx],
                         ids=["status-line", "headers", "1xx-flood"])
@pytest.mark.parametrize("route", ["proxy", "direct"])
def test_the_whole_exchange_ends_at_the_tiers_deadline(behaviour, route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through sleuth's own client: via an https proxy (the CONNECT exchange is what stalls) and, with the
    scheme rule relaxed for the test only, a plain GET to the server itself."""
    for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY",
                 "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    policy = HttpPolicy(total_timeout_s=DEADLINE_S, request_timeout_s=20.0, max_attempts=4)
    with StallingServer(behaviour) as server:
        if route == "proxy":
            monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{server.port}")
            url, hosts = "https://raw.githubusercontent.com/o/r/main/f.py", ["raw.githubusercontent.com"]
        else:
            monkeypatch.setattr(http, "check_url", lambda url, allowed: "127.0.0.1")
            url, hosts = f"http://127.0.0.1:{server.port}/f.py", ["127.0.0.1"]
        client = http.new_client(policy)
        try:
            start = time.monotonic()
            with pytest.raises(FetchFailure) as failure:
                http.get(client, url, allowed_hosts=hosts, deadline=http.monotonic() + DEADLINE_S, policy=policy)
            elapsed = time.monotonic() - start
        finally:
            client.close()
        assert server.connections >= 1
    print(f"{behaviour.__name__} ({route}): gave up after {elapsed:.2f} s with a {DEADLINE_S} s deadline")
    assert elapsed < DEADLINE_S + SLACK_S
    assert "time bound" in str(failure.value)


def test_a_probe_interpreter_that_hangs_is_killed_with_its_group(tmp_path: Path) -> None:
    """A wrapper script that starts a child and sleeps: both are gone once sleuth gives up on it."""
    from sleuth.probes.sandbox import SandboxError, interpreter_facts

    marker = f"sleuth-hung-{uuid.uuid4().hex}"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nsh -c 'sleep 300; : {marker}' &\nexec sh -c 'sleep 301; : {marker}'\n")
    fake.chmod(0o755)
    start = time.monotonic()
    with pytest.raises(SandboxError, match="did not start within 1 s"):
        interpreter_facts(str(fake), {"PATH": os.environ["PATH"]}, tmp_path, timeout_s=1.0)
    elapsed = time.monotonic() - start
    time.sleep(0.2)
    left = [pid for pid in _pids_with(marker)]
    for pid in left:  # hygiene for a failing run
        os.kill(pid, signal.SIGKILL)
    assert elapsed < 1.0 + SLACK_S
    assert left == []


def _pids_with(marker: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                status = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if marker.encode() in cmdline and ") Z " not in status:
                found.append(int(entry))
    return found


def test_the_cli_gives_up_on_a_hung_probe_python_and_leaves_no_process(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Through `sleuth probe init` (in-process, with the interpreter's deadline shortened): it says why the
    pieces could not be called, goes on from the static reading, and the fake interpreter's whole group is gone."""
    from sleuth_helpers import invoke

    from sleuth.probes import sandbox

    monkeypatch.setattr(sandbox, "FACTS_TIMEOUT_S", 1.0)
    marker = f"sleuth-hung-cli-{uuid.uuid4().hex}"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nsh -c 'sleep 300; : {marker}' &\nexec sh -c 'sleep 301; : {marker}'\n")
    fake.chmod(0o755)
    code = tmp_path / "code"
    code.mkdir()
    (code / "drafter.py").write_text("BLOCK_SIZE = 8\n")
    start = time.monotonic()
    exit_code, out, err, exc = invoke(["probe", "init", "--code", str(code), "--probe-python", str(fake),
                                       "--out", str(tmp_path / "entry.py")])
    elapsed = time.monotonic() - start
    time.sleep(0.2)
    left = _pids_with(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert exc is None, exc
    assert "did not start within 1 s" in out + err and exit_code == 0, out + err
    assert elapsed < 30
    assert left == []
