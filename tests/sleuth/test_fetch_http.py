"""The raw and docs tiers on a mocked wire (respx): what a good file is, retries, time bounds, the token.

No checkout and an unreachable git URL, so the chain reaches the HTTP tiers; sleeps are recorded, not
waited, so Retry-After and backoff are checked exactly and the tests stay fast.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest
import respx

from sleuth.reference import ReferenceError, http, resolve_reference
from sleuth.reference.http import FetchFailure, check_url

REPO = "vllm-project/speculators"
SHA = "f" * 40
NEEDED = ["src/speculators/models/dflash/core.py", "src/speculators/losses/utils.py",
          "docs/user_guide/algorithms/dflash.md"]
DOCS_URL = "https://docs.example.test/dflash/"
RAW = f"https://raw.githubusercontent.com/{REPO}/{SHA}/"
API = f"https://api.github.com/repos/{REPO}/commits/main"
GOOD = {
    NEEDED[0]: b'"""stand-in core"""\n\ndef decay(k, gamma):\n    return k / gamma\n',
    NEEDED[1]: b"WEIGHT = 1.0\n",
    NEEDED[2]: b"# DFlash\n\nA stand-in page.\n",
}


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SLEUTH_CONFIG_FILE", str(tmp_path / "no-config.yaml"))
    monkeypatch.delenv("SLEUTH_SPECULATORS_PATH", raising=False)
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    playbooks = tmp_path / "playbooks"
    (playbooks / "references").mkdir(parents=True)
    (playbooks / "references" / "speculators.yaml").write_text(f"""\
repository: {REPO}
url: {(tmp_path / 'no-such-upstream.git').as_uri()}
files: {json.dumps(NEEDED)}
docs: [{{url: "{DOCS_URL}"}}, {{url: "https://elsewhere.example.test/page"}}]
allowed_hosts: [api.github.com, raw.githubusercontent.com, docs.example.test]
pinned_commit: {"c" * 40}
pinned:
  dflash.loss_decay_gamma: {{expected: 4.0, location: "src/speculators/losses/utils.py:17-48"}}
""")
    monkeypatch.setenv("SLEUTH_PLAYBOOKS_DIR", str(playbooks))


@pytest.fixture()
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    recorded: list[float] = []
    monkeypatch.setattr(http, "sleep", recorded.append)
    return recorded


TREE = f"https://api.github.com/repos/{REPO}/git/trees/{SHA}?recursive=1"


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def serve_good_files(mock: respx.MockRouter, skip: str | None = None) -> None:
    mock.get(API).respond(200, text=SHA)
    mock.get(TREE).respond(200, json={"sha": SHA, "truncated": False, "tree": [
        {"path": path, "type": "blob", "mode": "100644", "sha": git_blob_sha(body), "size": len(body)}
        for path, body in GOOD.items()]})
    for path, body in GOOD.items():
        if path != skip:
            mock.get(RAW + path).respond(200, content=body)


def tier(res, name: str):
    return next(a for a in res.trace if a.tier == name)


@respx.mock(assert_all_called=False)
def test_raw_200_pins_the_commit_and_hashes_the_bytes(respx_mock: respx.MockRouter) -> None:
    serve_good_files(respx_mock)

    res = resolve_reference("speculators")

    assert res.tier == "raw" and res.commit == SHA
    for file in res.files:
        assert file.sha256 == hashlib.sha256(GOOD[file.path]).hexdigest()
        assert file.source == RAW + file.path and file.commit == SHA and file.tier == "raw"
    assert tier(res, "git-pull").outcome == "error"  # the file:// upstream does not exist
    hosts = {call.request.url.host for call in respx_mock.calls}
    assert hosts == {"api.github.com", "raw.githubusercontent.com"}  # never github.com HTML pages


def test_raw_files_are_cached_by_commit_and_read_offline(tmp_path: Path) -> None:
    with respx.mock(assert_all_called=False) as mock:
        serve_good_files(mock)
        online = resolve_reference("speculators")
    cache = tmp_path / "cache" / "references" / "speculators"
    assert (cache / "refs" / "main").read_text() == SHA
    assert (cache / "snapshots" / SHA / NEEDED[0]).read_bytes() == GOOD[NEEDED[0]]

    offline = resolve_reference("speculators", offline=True)

    assert offline.tier == "local" and offline.commit == SHA
    assert [f.sha256 for f in offline.files] == [f.sha256 for f in online.files]
    assert all(f.tier == "raw" and "cached from https://raw.githubusercontent.com" in f.source for f in offline.files)


@respx.mock(assert_all_called=False)
def test_raw_404_falls_back_to_docs_then_pinned(respx_mock: respx.MockRouter) -> None:
    serve_good_files(respx_mock, skip=NEEDED[0])
    respx_mock.get(RAW + NEEDED[0]).respond(404)
    respx_mock.get(DOCS_URL).respond(200, html="<html><body>DFlash docs</body></html>")

    res = resolve_reference("speculators")

    raw = tier(res, "raw")
    assert raw.outcome == "partial" and "core.py: HTTP 404" in raw.reason
    assert res.files == [] and res.tier == "docs"
    assert [d.path for d in res.docs] == [DOCS_URL] and res.docs[0].tier == "docs" and res.docs[0].commit is None
    assert "elsewhere.example.test is not in the reference's allowlist" in tier(res, "docs").reason
    assert not any(c.request.url.host == "elsewhere.example.test" for c in respx_mock.calls)
    assert res.pinned["dflash.loss_decay_gamma"]["expected"] == 4.0


@respx.mock(assert_all_called=False)
def test_429_honours_retry_after(respx_mock: respx.MockRouter, sleeps: list[float]) -> None:
    serve_good_files(respx_mock, skip=NEEDED[1])
    respx_mock.get(RAW + NEEDED[1]).mock(side_effect=[
        httpx.Response(429, headers={"Retry-After": "3"}), httpx.Response(200, content=GOOD[NEEDED[1]])])

    res = resolve_reference("speculators")

    assert res.tier == "raw" and sleeps == [3.0]


@respx.mock(assert_all_called=False)
def test_500_backs_off_exponentially_then_gives_up(respx_mock: respx.MockRouter, sleeps: list[float]) -> None:
    serve_good_files(respx_mock, skip=NEEDED[1])
    route = respx_mock.get(RAW + NEEDED[1]).respond(500)

    res = resolve_reference("speculators", policy=http.HttpPolicy(max_attempts=4, backoff_s=0.5))

    assert route.call_count == 4 and sleeps == [0.5, 1.0, 2.0]
    assert "utils.py: HTTP 500 after 4 attempts" in tier(res, "raw").reason
    assert res.tier == "pinned"  # the docs page is not mocked here, so that tier fails too


@respx.mock(assert_all_called=False)
def test_retry_after_beyond_the_time_bound_is_not_waited(respx_mock: respx.MockRouter, sleeps: list[float]) -> None:
    serve_good_files(respx_mock, skip=NEEDED[1])
    respx_mock.get(RAW + NEEDED[1]).respond(429, headers={"Retry-After": "3600"})

    res = resolve_reference("speculators", policy=http.HttpPolicy(total_timeout_s=30))

    assert sleeps == []
    assert "would pass the time bound" in tier(res, "raw").reason


@respx.mock(assert_all_called=False)
def test_timeouts_are_retried_and_reported(respx_mock: respx.MockRouter, sleeps: list[float]) -> None:
    serve_good_files(respx_mock, skip=NEEDED[1])
    route = respx_mock.get(RAW + NEEDED[1]).mock(side_effect=httpx.ReadTimeout("slow"))

    res = resolve_reference("speculators", policy=http.HttpPolicy(max_attempts=3))

    assert route.call_count == 3 and len(sleeps) == 2
    assert "utils.py: timed out after 3 attempts" in tier(res, "raw").reason


@respx.mock(assert_all_called=False)
def test_html_body_is_not_the_file(respx_mock: respx.MockRouter) -> None:
    serve_good_files(respx_mock, skip=NEEDED[0])
    respx_mock.get(RAW + NEEDED[0]).respond(200, text="<!DOCTYPE html><html><head></head><body>Not Found</body></html>")

    res = resolve_reference("speculators")

    assert "core.py: an HTML page came back, not the file" in tier(res, "raw").reason
    assert res.files == []


@respx.mock(assert_all_called=False)
def test_truncated_bodies_are_rejected(respx_mock: respx.MockRouter) -> None:
    serve_good_files(respx_mock, skip=NEEDED[0])
    cut = GOOD[NEEDED[0]][:40]  # ends inside the def: no longer Python
    respx_mock.get(RAW + NEEDED[0]).respond(200, content=cut)

    res = resolve_reference("speculators")
    assert "core.py: does not parse as Python" in tier(res, "raw").reason

    respx_mock.get(RAW + NEEDED[0]).respond(200, content=cut, headers={"Content-Length": str(len(GOOD[NEEDED[0]]))})
    res = resolve_reference("speculators")
    assert f"core.py: truncated: {len(cut)} of {len(GOOD[NEEDED[0]])} bytes" in tier(res, "raw").reason


@respx.mock(assert_all_called=False)
def test_api_down_reads_the_branch_unpinned(respx_mock: respx.MockRouter, sleeps: list[float]) -> None:
    respx_mock.get(API).respond(503)
    for path, body in GOOD.items():
        respx_mock.get(f"https://raw.githubusercontent.com/{REPO}/main/{path}").respond(200, content=body)

    res = resolve_reference("speculators")

    assert res.tier == "raw" and res.commit is None and all(f.commit is None for f in res.files)
    assert "unpinned" in tier(res, "raw").reason


def test_github_token_is_sent_to_github_only_and_never_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "ghp_" + "s3cr3t" * 6
    monkeypatch.setenv("GITHUB_TOKEN", secret)
    with respx.mock(assert_all_called=False) as mock:
        serve_good_files(mock, skip=NEEDED[0])
        mock.get(RAW + NEEDED[0]).respond(401)
        mock.get(DOCS_URL).respond(200, html="<html>docs</html>")
        res = resolve_reference("speculators")
        calls = list(mock.calls)

    for call in calls:
        sent = call.request.headers.get("Authorization")
        assert sent == (f"Bearer {secret}" if call.request.url.host != "docs.example.test" else None)
    assert secret not in res.model_dump_json()
    for file in (tmp_path / "cache").rglob("*"):
        if file.is_file():
            assert secret.encode() not in file.read_bytes()


def test_github_html_tree_and_blob_pages_are_refused() -> None:
    hosts = ["github.com", "raw.githubusercontent.com"]
    for page in ("tree", "blob"):
        with pytest.raises(FetchFailure, match="refusing GitHub HTML page"):
            check_url(f"https://github.com/{REPO}/{page}/main/src", hosts)
    with pytest.raises(FetchFailure, match="non-https"):
        check_url(f"http://raw.githubusercontent.com/{REPO}/main/x.py", hosts)
    assert check_url(f"https://raw.githubusercontent.com/{REPO}/main/x.py", hosts) == "raw.githubusercontent.com"


def test_docs_are_cached_and_read_offline() -> None:
    with respx.mock(assert_all_called=False) as mock:
        mock.route(host="api.github.com").respond(404)
        mock.route(host="raw.githubusercontent.com").respond(404)
        mock.get(DOCS_URL).respond(200, html="<html>DFlash docs v1</html>")
        online = resolve_reference("speculators")

    offline = resolve_reference("speculators", offline=True)

    assert online.tier == offline.tier == "docs"
    assert offline.docs[0].sha256 == online.docs[0].sha256 == hashlib.sha256(b"<html>DFlash docs v1</html>").hexdigest()
    assert offline.docs[0].source == f"cache (from {DOCS_URL})"


@respx.mock(assert_all_called=False)
def test_a_gzipped_reply_is_not_mistaken_for_a_truncated_one(respx_mock: respx.MockRouter) -> None:
    # Content-Length counts the compressed bytes on the wire; the decoded body is longer, and complete.
    import gzip

    serve_good_files(respx_mock, skip=NEEDED[0])
    packed = gzip.compress(GOOD[NEEDED[0]])
    respx_mock.get(RAW + NEEDED[0]).respond(
        200, content=packed, headers={"Content-Encoding": "gzip", "Content-Length": str(len(packed))}
    )
    res = resolve_reference("speculators")
    assert res.tier == "raw", tier(res, "raw").reason
    assert {f.path for f in res.files} == set(NEEDED)


def test_a_ref_that_could_walk_a_path_or_url_is_refused() -> None:
    with pytest.raises(ReferenceError, match="is not a branch, tag or commit name"):
        resolve_reference("speculators", ref="../../etc", offline=True)
