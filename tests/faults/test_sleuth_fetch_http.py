"""The HTTP tiers against servers that misbehave: a gzip bomb, a drip, empty and cut bodies, a redirect to
another host, no network at all. Each: the tier gives up within its bounds, says why in one line, falls
back, and caches nothing it could not vouch for.

The chain only speaks https to GitHub's hosts, so whole-chain cases run on respx (the wire mocked, the
client real); the bounded body reader is also run against a real socket on 127.0.0.1 for the cases where
real time and real memory are the point (drip, bomb), and a real refused connection stands for no network.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import respx
from sleuth_helpers import (
    NEEDED,
    REPO,
    LoopbackServer,
    assert_no_secret_under,
    closed_port,
    drip,
    git_blob_sha,
    gzip_bomb,
    isolate,
    serve_bytes,
    stand_in,
)

from sleuth.reference import http, resolve_reference
from sleuth.reference.http import FetchFailure, HttpPolicy

SHA = "a" * 40
API = f"https://api.github.com/repos/{REPO}/commits/main"
TREE = f"https://api.github.com/repos/{REPO}/git/trees/{SHA}?recursive=1"
RAW = f"https://raw.githubusercontent.com/{REPO}/{SHA}/"
DOCS = "https://docs.example.test/dflash/"
GOOD = {path: stand_in(path) for path in NEEDED}
ALLOWED = ["api.github.com", "raw.githubusercontent.com", "docs.example.test"]


@pytest.fixture(autouse=True)
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An unreachable git URL, so the chain reaches the HTTP tiers without a socket of its own.
    isolate(tmp_path, monkeypatch, url=(tmp_path / "no-such-upstream.git").as_uri(), allowed_hosts=ALLOWED,
            docs=[DOCS])


def serve(mock: respx.MockRouter, files: dict[str, bytes] | None = None, *, tree: bool = True) -> None:
    files = GOOD if files is None else files
    mock.get(API).respond(200, text=SHA)
    if tree:
        mock.get(TREE).respond(200, json={"sha": SHA, "truncated": False, "tree": [
            {"path": p, "type": "blob", "mode": "100644", "sha": git_blob_sha(b), "size": len(b)}
            for p, b in GOOD.items()]})
    else:
        mock.get(TREE).respond(404)
    for path, body in files.items():
        mock.get(RAW + path).respond(200, content=body)
    mock.get(DOCS).respond(404)


def raw_attempt(res):
    return next(a for a in res.trace if a.tier == "raw")


def cached_files(tmp_path: Path) -> list[Path]:
    return [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and "snapshots" in p.parts]


# --- integrity: empty and cut bodies ----------------------------------------------------------------------

def test_an_empty_200_is_not_the_file_and_is_never_cached(tmp_path: Path) -> None:
    with respx.mock(assert_all_called=False) as mock:
        serve(mock, {**GOOD, NEEDED[1]: b""})
        res = resolve_reference("speculators")
    assert res.tier == "pinned"
    assert "core.py: empty body (HTTP 200 with 0 bytes)" in raw_attempt(res).reason
    assert cached_files(tmp_path) == []
    assert resolve_reference("speculators", offline=True).tier == "pinned"  # nothing poisoned for later


def test_a_python_file_cut_at_a_line_boundary_parses_but_is_refused_by_its_blob_sha(tmp_path: Path) -> None:
    whole = GOOD[NEEDED[1]]
    cut = whole[: whole.rindex(b"\nVERSION") + 1]  # ends on a line boundary: still valid Python
    compile(cut, "core.py", "exec")
    with respx.mock(assert_all_called=False) as mock:
        serve(mock, {**GOOD, NEEDED[1]: cut})
        res = resolve_reference("speculators")
    assert res.tier == "pinned"
    assert f"core.py: {len(cut)} bytes that are not the file's blob" in raw_attempt(res).reason
    assert cached_files(tmp_path) == []


def test_without_the_git_tree_bytes_serve_the_run_but_are_never_cached(tmp_path: Path) -> None:
    with respx.mock(assert_all_called=False) as mock:
        serve(mock, tree=False)
        res = resolve_reference("speculators")
    assert res.tier == "raw" and all(f.git_blob_sha is None for f in res.files)
    assert "not checked against the git tree" in raw_attempt(res).reason
    assert cached_files(tmp_path) == []


def test_verified_bytes_are_cached_and_a_tampered_cache_entry_is_not_trusted(tmp_path: Path) -> None:
    with respx.mock(assert_all_called=False) as mock:
        serve(mock)
        res = resolve_reference("speculators")
    assert res.tier == "raw" and all(f.git_blob_sha == git_blob_sha(GOOD[f.path]) for f in res.files)
    assert resolve_reference("speculators", offline=True).tier == "local"
    snapshot = tmp_path / "cache" / "references" / "speculators" / "snapshots" / SHA / NEEDED[1]
    snapshot.write_bytes(b"")
    assert resolve_reference("speculators", offline=True).tier == "pinned"


def test_a_gzip_stream_cut_short_is_truncated(tmp_path: Path) -> None:
    import gzip

    packed = gzip.compress(GOOD[NEEDED[1]])[:-6]
    with respx.mock(assert_all_called=False) as mock:
        serve(mock)
        mock.get(RAW + NEEDED[1]).respond(200, content=packed, headers={"Content-Encoding": "gzip"})
        res = resolve_reference("speculators")
    assert "core.py: truncated: the compressed body ends early" in raw_attempt(res).reason
    assert cached_files(tmp_path) == []


# --- size and inflation bounds ----------------------------------------------------------------------------

def test_a_gzip_bomb_stops_early(tmp_path: Path) -> None:
    bomb = gzip_bomb()
    assert len(bomb) < 1_200_000
    start = time.perf_counter()
    with respx.mock(assert_all_called=False) as mock:
        serve(mock)
        # A generator body: respx would otherwise read (and inflate) a bytes body itself before we see it.
        mock.get(RAW + NEEDED[1]).mock(side_effect=lambda request: httpx.Response(
            200, headers={"Content-Encoding": "gzip"},
            content=(bomb[i:i + 65536] for i in range(0, len(bomb), 65536))))
        res = resolve_reference("speculators")
    assert time.perf_counter() - start < 10
    assert "refused as a decompression bomb" in raw_attempt(res).reason
    assert res.tier == "pinned" and cached_files(tmp_path) == []


def test_a_declared_body_over_the_cap_is_not_read(tmp_path: Path) -> None:
    with respx.mock(assert_all_called=False) as mock:
        serve(mock)
        mock.get(RAW + NEEDED[1]).respond(200, content=b"x", headers={"Content-Length": str(1 << 40)})
        res = resolve_reference("speculators")
    assert "is over the 16 MiB cap" in raw_attempt(res).reason


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc to read peak RSS")
def test_the_bomb_on_a_real_socket_keeps_memory_low(tmp_path: Path) -> None:
    """In a fresh process, so its peak RSS is the reader's: 1 MiB of gzip that would inflate to 1 GiB."""
    bomb = tmp_path / "bomb.gz"
    bomb.write_bytes(gzip_bomb())
    script = textwrap.dedent(f"""
        import json, sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import httpx
        from sleuth_helpers import LoopbackServer, serve_bytes
        from sleuth.reference.http import FetchFailure, HttpPolicy, _read_body
        body = open({str(bomb)!r}, "rb").read()
        def status(key):
            line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
            return int(line.split()[1])
        try:  # reset the high-water mark, so the peak measured is the read's own
            open("/proc/self/clear_refs", "w").write("5")
        except OSError:
            pass
        before = status("VmRSS")
        with LoopbackServer({{"/bomb": serve_bytes(body, {{"Content-Encoding": "gzip"}})}}) as server:
            start = time.perf_counter()
            with httpx.Client() as client, client.stream("GET", server.url("/bomb")) as response:
                try:
                    _read_body(response, server.url("/bomb"), time.monotonic() + 60, HttpPolicy())
                    outcome = "read"
                except FetchFailure as exc:
                    outcome = str(exc)
            elapsed = time.perf_counter() - start
        peak = status("VmHWM")
        print(json.dumps({{"outcome": outcome, "seconds": elapsed, "rss_before_kib": before, "peak_rss_kib": peak}}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    print("bomb on a real socket:", measured)
    assert "refused as a decompression bomb" in measured["outcome"]
    assert measured["peak_rss_kib"] - measured["rss_before_kib"] < 64 * 1024  # under 64 MiB, not 1 GiB


# --- time bounds ------------------------------------------------------------------------------------------

def test_a_drip_is_cut_off_at_the_tier_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte every 2 s (on a simulated clock): the raw tier gives up at its bound, not after the file."""
    clock = [1000.0]
    monkeypatch.setattr(http, "monotonic", lambda: clock[0])
    monkeypatch.setattr(http, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))

    def dripping():
        for _ in range(10_000):
            clock[0] += 2.0
            yield b"#"

    with respx.mock(assert_all_called=False) as mock:
        serve(mock)
        mock.get(RAW + NEEDED[1]).mock(return_value=httpx.Response(
            200, headers={"Content-Length": "10000"}, content=dripping()))
        start = clock[0]
        res = resolve_reference("speculators", policy=HttpPolicy(total_timeout_s=90))
    raw = raw_attempt(res)
    assert "time bound reached while reading the body" in raw.reason
    assert clock[0] - start <= 90 + 2 + 1e-6  # the bound, plus at most the one gap that crossed it


def test_a_drip_on_a_real_socket_is_cut_off_at_the_deadline() -> None:
    with LoopbackServer({"/drip": drip(2.0)}, lifetime_s=30) as server, httpx.Client() as client:
        start = time.monotonic()
        with client.stream("GET", server.url("/drip"), timeout=10) as response:
            with pytest.raises(FetchFailure, match="time bound reached while reading the body"):
                http._read_body(response, server.url("/drip"), start + 5.0, HttpPolicy())
        elapsed = time.monotonic() - start
    print(f"drip on a real socket: gave up after {elapsed:.2f} s with a 5 s deadline")
    assert elapsed < 5.0 + 2.0 + 0.5


def test_no_network_falls_back_in_under_3_seconds_and_tries_each_host_once(tmp_path: Path) -> None:
    with respx.mock(assert_all_called=False) as mock:
        for host in ("api.github.com", "raw.githubusercontent.com", "docs.example.test"):
            mock.route(host=host).mock(side_effect=httpx.ConnectError("[Errno -3] Temporary failure in name resolution"))
        start = time.perf_counter()
        res = resolve_reference("speculators")
        elapsed = time.perf_counter() - start
        hosts = [call.request.url.host for call in mock.calls]
    print(f"no network (respx ConnectError): pinned after {elapsed:.3f} s")
    assert res.tier == "pinned" and elapsed < 3.0
    assert sorted(hosts) == ["api.github.com", "docs.example.test", "raw.githubusercontent.com"]
    assert "could not be reached earlier; not tried again" in raw_attempt(res).reason


def test_a_refused_connection_on_a_real_socket_falls_back_in_under_3_seconds() -> None:
    """Every request goes through a proxy on a closed loopback port: a real refused connection."""
    client = httpx.Client(proxy=f"http://127.0.0.1:{closed_port()}", timeout=20)
    try:
        start = time.perf_counter()
        res = resolve_reference("speculators", client=client)
        elapsed = time.perf_counter() - start
    finally:
        client.close()
    print(f"no network (refused on a real socket): pinned after {elapsed:.3f} s")
    assert res.tier == "pinned" and elapsed < 3.0


# --- hosts ------------------------------------------------------------------------------------------------

def test_a_redirect_to_another_host_is_refused_and_never_followed(tmp_path: Path) -> None:
    with respx.mock(assert_all_called=False) as mock:
        serve(mock)
        mock.get(RAW + NEEDED[1]).respond(302, headers={"Location": "https://evil.example.test/core.py"})
        evil = mock.route(host="evil.example.test").respond(200, content=GOOD[NEEDED[1]])
        res = resolve_reference("speculators")
    assert not evil.called
    assert "host evil.example.test is not in the reference's allowlist" in raw_attempt(res).reason


def test_a_docs_url_with_a_token_in_its_query_is_never_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "qT0ken" * 5
    url = f"https://docs.example.test/dflash/?access_token={secret}"
    isolate(tmp_path, monkeypatch, url=(tmp_path / "none.git").as_uri(), allowed_hosts=ALLOWED, docs=[url])
    with respx.mock(assert_all_called=False) as mock:
        mock.route(host="api.github.com").respond(404)
        mock.route(host="raw.githubusercontent.com").respond(404)
        mock.route(host="docs.example.test").respond(200, html="<html>DFlash</html>")
        res = resolve_reference("speculators")
    assert res.tier == "docs"
    assert secret not in res.model_dump_json()
    assert_no_secret_under(secret, tmp_path / "cache")


def test_an_unreachable_git_host_is_not_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """git's https transport waits up to 300 s to connect; the git-pull tier probes the host first."""
    for var in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    url = f"https://127.0.0.1:{closed_port()}/vllm-project/speculators.git"
    isolate(tmp_path, monkeypatch, url=url, allowed_hosts=[*ALLOWED, "127.0.0.1"], docs=[DOCS])
    with respx.mock(assert_all_called=False) as mock:
        for host in ("api.github.com", "raw.githubusercontent.com", "docs.example.test"):
            mock.route(host=host).mock(side_effect=httpx.ConnectError("[Errno 101] Network is unreachable"))
        start = time.perf_counter()
        res = resolve_reference("speculators")
        elapsed = time.perf_counter() - start
    pull = next(a for a in res.trace if a.tier == "git-pull")
    print(f"no network (git host refused, HTTP hosts unreachable): pinned after {elapsed:.3f} s")
    assert "not tried: cannot connect to 127.0.0.1" in pull.reason
    assert res.tier == "pinned" and elapsed < 3.0
    assert not (tmp_path / "cache" / "references" / "speculators" / "git").exists()  # no empty clone left
