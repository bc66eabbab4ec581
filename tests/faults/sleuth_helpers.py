"""Shared parts of sleuth's fault tests: a loopback HTTP server that misbehaves on request, reference
repositories and checkouts built with gitpython, a run directory that follows the contract, snapshots of
everything of the user's that must survive, and the one-line / no-secret / no-traceback assertions.

Imported by tests/faults/test_sleuth_*.py (pytest puts this folder on sys.path; there is no conftest here
so that other fault suites stay independent).
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import socket
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import git
import pytest

ROOT = Path(__file__).resolve().parents[2]
REPO = "vllm-project/speculators"
DFLASH = "src/speculators/models/dflash/"
NEEDED = [DFLASH + "__init__.py", DFLASH + "core.py", "src/speculators/losses/utils.py"]
SECRET = "ghs_" + "Zq9" * 12  # the shape of a GitHub installation token; never a real one


def stand_in(path: str, version: int = 1) -> bytes:
    """Our own few lines at each reference path (never fetched code)."""
    return (f'"""Stand-in for {path}, version {version}."""\n\n'
            f"def weight(k: int, gamma: float = 4.0) -> float:\n"
            f"    return 2.718281828 ** (-(k - 1) / gamma)\n\n"
            f"VERSION = {version}\n").encode()


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # noqa: S324 - git's object id


# --- environment -----------------------------------------------------------------------------------------

def isolate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, url: str, allowed_hosts: list[str],
            docs: list[str] | None = None, needed: list[str] | None = None) -> Path:
    """Cache, config and playbooks in tmp_path; a speculators definition pointing at `url`. Returns the
    playbooks root."""
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SLEUTH_CONFIG_FILE", str(tmp_path / "no-config.yaml"))
    monkeypatch.delenv("SLEUTH_SPECULATORS_PATH", raising=False)
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    monkeypatch.delenv("SLEUTH_DEBUG", raising=False)
    for var in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
        monkeypatch.setenv(var, "Test")
    for var in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(var, "test@example.test")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    playbooks = tmp_path / "playbooks"
    (playbooks / "references").mkdir(parents=True, exist_ok=True)
    # The invariants playbooks move with SLEUTH_PLAYBOOKS_DIR too; the shipped ones are copied beside ours.
    for shipped in (ROOT / "playbooks").glob("*.yaml"):
        shutil.copy(shipped, playbooks / shipped.name)
    docs_yaml = json.dumps([{"url": u} for u in (docs or [])])
    (playbooks / "references" / "speculators.yaml").write_text(f"""\
repository: {REPO}
url: {url}
default_branch: main
files: {json.dumps(needed or NEEDED)}
docs: {docs_yaml}
allowed_hosts: {json.dumps(allowed_hosts)}
pinned_commit: {"c" * 40}
pinned:
  dflash.loss_decay_gamma: {{expected: 4.0, location: "src/speculators/losses/utils.py:1-2"}}
""")
    monkeypatch.setenv("SLEUTH_PLAYBOOKS_DIR", str(playbooks))
    return playbooks


# --- git -------------------------------------------------------------------------------------------------

class Upstream:
    """A bare upstream and an author clone; `commit` writes files and pushes."""

    def __init__(self, root: Path) -> None:
        self.bare_dir = root / "upstream.git"
        git.Repo.init(self.bare_dir, bare=True, initial_branch="main")
        self.work = git.Repo.init(root / "author", initial_branch="main")
        self.work.create_remote("origin", self.bare_dir.as_uri())
        self.url = self.bare_dir.as_uri()

    def commit(self, files: dict[str, bytes], message: str = "update") -> str:
        for path, data in files.items():
            target = Path(self.work.working_tree_dir) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            self.work.index.add([path])
        sha = self.work.index.commit(message).hexsha
        self.work.git.push("origin", "main")
        return sha

    def clone(self, dest: Path) -> git.Repo:
        return git.Repo.clone_from(self.url, dest)


def user_state(repo_dir: Path) -> dict[str, bytes | str]:
    """Everything of the user's that must come back byte-identical: work tree files, index, HEAD,
    ORIG_HEAD, config, local branches and tags, HEAD's reflog, any in-progress marker."""
    state: dict[str, bytes | str] = {}
    for file in sorted(repo_dir.rglob("*")):
        relative = file.relative_to(repo_dir)
        if file.is_file() and ".git" not in relative.parts:
            state[f"file:{relative}"] = file.read_bytes()
    git_dir = repo_dir / ".git"
    for name in ("index", "HEAD", "ORIG_HEAD", "config", "shallow", "MERGE_HEAD", "logs/HEAD", "packed-refs"):
        if (git_dir / name).exists():
            state[f"git:{name}"] = (git_dir / name).read_bytes()
    for ref in sorted((git_dir / "refs").rglob("*")):
        if ref.is_file() and "remotes" not in ref.relative_to(git_dir).parts:
            state[f"ref:{ref.relative_to(git_dir)}"] = ref.read_bytes()
    return state


# --- a run directory --------------------------------------------------------------------------------------

def write_run(root: Path, name: str, *, created: str = "2026-11-01T10:00:00+00:00",
              rows: list[dict[str, Any]] | None = None) -> Path:
    """A small run directory per the README's run-directory contract."""
    from safetensors.numpy import save_file
    import numpy as np

    run = root / name
    (run / "checkpoints" / "step-300").mkdir(parents=True)
    (run / "code").mkdir()
    config = {"block_size": 8, "draft_layers": 1, "target_layer_ids": [1, 3, 5], "loss_decay_gamma": 4.0,
              "steps": 300}
    (run / "config.json").write_text(json.dumps(config))
    (run / "run.json").write_text(json.dumps({
        "name": name, "preset": "fixed", "created": created, "status": "completed", "steps_done": 300,
        "target": {"path": "embedded", "fingerprint": "t" * 16, "num_layers": 12, "hidden_size": 16},
        "data": {"source": "embedded", "fingerprint": "d" * 16},
    }))
    if rows is None:
        rows = [{"step": s, "loss": 5.0 - 0.01 * s, "acc": 0.001 * s, "streak": 0.01 * s, "tau": 1 + 0.01 * s}
                for s in range(10, 301, 10)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    save_file({"fc.weight": np.zeros((16, 48), dtype=np.float32)},
              str(run / "checkpoints" / "step-300" / "drafter.safetensors"))
    (run / "checkpoints" / "latest").write_text("step-300\n")
    (run / "code" / "drafter.py").write_text("BLOCK_SIZE = 8\n\ndef decay(k, gamma=4.0):\n    return k / gamma\n")
    return run


# --- the loopback server ----------------------------------------------------------------------------------

Behaviour = Callable[[BaseHTTPRequestHandler], None]


class LoopbackServer:
    """A real HTTP server on 127.0.0.1 with one behaviour per path, recording every connection.

    Bounded on every side: each connection times out, the server shuts itself down after `lifetime_s`
    even if a test forgets to, and behaviours that loop (a drip) stop when the server stops."""

    def __init__(self, routes: dict[str, Behaviour], *, lifetime_s: float = 60.0) -> None:
        self.routes = routes
        self.requests: list[str] = []
        self.connections = 0
        self.stopping = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 10  # seconds a silent client may hold a connection

            def setup(self) -> None:
                server.connections += 1
                super().setup()

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                server.requests.append(self.path)
                behaviour = server.routes.get(self.path.split("?")[0])
                if behaviour is None:
                    self.send_error(404)
                    return
                try:
                    behaviour(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up, which is what several tests expect

            def log_message(self, *args: object) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._httpd.stopping = self.stopping  # type: ignore[attr-defined]
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
                                         daemon=True)
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def __enter__(self) -> LoopbackServer:
        self._thread.start()
        self._timer.start()
        return self

    def stop(self) -> None:
        if not self.stopping.is_set():
            self.stopping.set()
            self._httpd.shutdown()
            self._httpd.server_close()

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        self.stop()
        self._thread.join(timeout=5)


def drip(interval_s: float, total_bytes: int = 10_000) -> Behaviour:
    """200 with a Content-Length, then one byte every `interval_s` until the client or the server quits."""
    def behave(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(total_bytes))
        handler.end_headers()
        stopping: threading.Event = handler.server.stopping  # type: ignore[attr-defined]
        for _ in range(total_bytes):
            if stopping.is_set():
                return
            handler.wfile.write(b"x")
            handler.wfile.flush()
            time.sleep(interval_s)
    return behave


def serve_bytes(body: bytes, headers: dict[str, str] | None = None) -> Behaviour:
    def behave(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        for key, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            handler.send_header(key, value)
        handler.end_headers()
        handler.wfile.write(body)
    return behave


@functools.lru_cache(maxsize=2)
def gzip_bomb(inflated_bytes: int = 1 << 30, piece: int = 16 << 20) -> bytes:
    """A valid gzip body of about 1 MiB that inflates to `inflated_bytes` zeros.

    Compressing 1 GiB takes ~10 s, so one piece is compressed and ended with a full flush (which makes the
    next deflate block independent of it), then repeated: a valid stream, built in a fraction of a second."""
    assert inflated_bytes % piece == 0
    compressor = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    block = compressor.compress(bytes(piece)) + compressor.flush(zlib.Z_FULL_FLUSH)
    final = compressor.flush(zlib.Z_FINISH)
    crc = 0
    zeros = bytes(piece)
    for _ in range(inflated_bytes // piece):
        crc = zlib.crc32(zeros, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    trailer = crc.to_bytes(4, "little") + (inflated_bytes & 0xFFFFFFFF).to_bytes(4, "little")
    return header + block * (inflated_bytes // piece) + final + trailer


def closed_port() -> int:
    """A loopback port nothing listens on: connecting is refused at once, like a host with no route."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- assertions -------------------------------------------------------------------------------------------

def assert_one_line_error(stderr: str, exit_code: int, expected_code: int = 2) -> str:
    assert exit_code == expected_code, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    assert "Traceback" not in stderr and "internal error" not in stderr, stderr
    return lines[0]


def assert_no_secret_under(secret: str, *roots: Path) -> None:
    for root in roots:
        if not root.exists():
            continue
        for file in [root] if root.is_file() else root.rglob("*"):
            if file.is_file() and not file.is_symlink():
                assert secret.encode() not in file.read_bytes(), f"secret written to {file}"


def invoke(args: list[str]) -> tuple[int, str, str, BaseException | None]:
    """Run `sleuth ARGS` in-process (so respx can stand in for the network): (code, stdout, stderr, exc).
    An exception other than SystemExit is a traceback a user would have seen."""
    from typer.testing import CliRunner

    from sleuth.cli import app

    result = CliRunner().invoke(app, args)
    exc = result.exception if result.exception is not None and not isinstance(result.exception, SystemExit) else None
    return result.exit_code, result.stdout, result.stderr, exc
