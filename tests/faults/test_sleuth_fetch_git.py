"""The git tiers against checkouts in every odd state: a partial clone whose promisor is a host we may not
contact, a refused fast-forward, dirty, detached, no commits, a token in the remote URL.

For each: no network attempt that the host rules forbid (a real loopback server counts connections), the
user's checkout byte-identical afterwards (work tree, index, HEAD, ORIG_HEAD, branches, tags, HEAD's
reflog), one line and the right exit code from the CLI, and no secret in any output or file.
"""

from __future__ import annotations

import json
from pathlib import Path

import git
import pytest
import respx
from sleuth_helpers import (
    NEEDED,
    SECRET,
    LoopbackServer,
    Upstream,
    assert_no_secret_under,
    assert_one_line_error,
    closed_port,
    invoke,
    isolate,
    stand_in,
    user_state,
)

from sleuth.reference import resolve_reference

ALLOWED = ["github.com", "api.github.com", "raw.githubusercontent.com"]


@pytest.fixture(autouse=True)
def no_real_http():
    """The HTTP tiers, when reached, see GitHub answer 404: never the network."""
    with respx.mock(assert_all_called=False) as mock:
        mock.route(host="api.github.com").respond(404)
        mock.route(host="raw.githubusercontent.com").respond(404)
        yield mock


@pytest.fixture()
def upstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Upstream:
    up = Upstream(tmp_path)
    isolate(tmp_path, monkeypatch, url=up.url, allowed_hosts=ALLOWED)
    up.commit({"README.md": b"stand-in\n"}, "before DFlash")
    up.commit({p: stand_in(p) for p in NEEDED}, "add DFlash")
    return up


def tier(res, name: str):
    return next(a for a in res.trace if a.tier == name)


# --- partial clone: the promisor remote is a host we may not contact ---------------------------------------

def partial_clone_with_promisor(tmp_path: Path, promisor_url: str) -> Path:
    """A checkout made of loose objects with one needed blob missing, configured as a partial clone whose
    promisor is `promisor_url`: reading that blob is exactly when git would fetch it lazily."""
    user = tmp_path / "partial"
    repo = git.Repo.init(user, initial_branch="main")
    for path in NEEDED:
        (user / path).parent.mkdir(parents=True, exist_ok=True)
        (user / path).write_bytes(stand_in(path))
    repo.index.add(NEEDED)
    repo.index.commit("DFlash")
    missing = repo.git.rev_parse(f"HEAD:{NEEDED[1]}")
    (user / ".git" / "objects" / missing[:2] / missing[2:]).unlink()
    with repo.config_writer() as config:
        config.set_value("core", "repositoryformatversion", 1)
        config.set_value("extensions", "partialclone", "origin")
        config.set_value('remote "origin"', "url", promisor_url)
        config.set_value('remote "origin"', "fetch", "+refs/heads/*:refs/remotes/origin/*")
        config.set_value('remote "origin"', "promisor", "true")
        config.set_value('remote "origin"', "partialclonefilter", "blob:none")
    return user


@pytest.mark.parametrize("offline", [False, True], ids=["online", "offline"])
def test_a_promisor_outside_the_allowed_hosts_is_never_contacted(tmp_path: Path, upstream: Upstream,
                                                                 offline: bool) -> None:
    with LoopbackServer({}, lifetime_s=60) as server:
        user = partial_clone_with_promisor(tmp_path, server.url("/upstream.git"))
        before = user_state(user)
        res = resolve_reference("speculators", path=user, offline=offline)
        assert server.connections == 0, server.requests
    assert user_state(user) == before
    assert tier(res, "local").outcome == "error" and "git cat-file failed" in tier(res, "local").reason
    assert res.tier == "pinned"


def test_a_promisor_on_an_allowed_host_may_be_contacted(tmp_path: Path, upstream: Upstream,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule is the host allowlist, not a blanket ban: allowed, git does try its promisor."""
    isolate(tmp_path, monkeypatch, url=upstream.url, allowed_hosts=[*ALLOWED, "127.0.0.1"])
    with LoopbackServer({}, lifetime_s=60) as server:
        user = partial_clone_with_promisor(tmp_path, server.url("/upstream.git"))
        resolve_reference("speculators", path=user)
        assert server.connections > 0


def test_the_cli_on_a_forbidden_promisor_is_calm(tmp_path: Path, upstream: Upstream) -> None:
    with LoopbackServer({}, lifetime_s=60) as server:
        user = partial_clone_with_promisor(tmp_path, server.url("/upstream.git"))
        code, out, err, exc = invoke(["fetch-reference", "speculators", "--path", str(user)])
        assert server.connections == 0
    assert exc is None and code == 1  # pinned facts only
    assert "Traceback" not in out + err


# --- the fast-forward that git refuses -------------------------------------------------------------------

def stale_checkout(tmp_path: Path, upstream: Upstream) -> tuple[Path, str]:
    """A clean checkout tracking origin/main one commit behind, with a valid ORIG_HEAD from earlier work."""
    user = tmp_path / "user"
    repo = upstream.clone(user)
    old_head = repo.head.commit.hexsha
    upstream.commit({p: stand_in(p, 2) for p in NEEDED} | {"notes/new file ü.txt": b"upstream's\n"}, "v2")
    (user / ".git" / "ORIG_HEAD").write_text(repo.head.commit.parents[0].hexsha + "\n")
    return user, old_head


def test_an_untracked_file_in_the_way_stops_the_fast_forward_before_git_runs(tmp_path: Path,
                                                                              upstream: Upstream) -> None:
    user, old_head = stale_checkout(tmp_path, upstream)
    (user / "notes").mkdir()
    (user / "notes" / "new file ü.txt").write_text("mine, not committed\n")
    before = user_state(user)

    res = resolve_reference("speculators", path=user)

    assert user_state(user) == before
    pull = tier(res, "git-pull")
    assert "left your checkout untouched (the fast-forward would overwrite your untracked notes/new file ü.txt)" in pull.reason
    assert res.tier == "git-pull" and git.Repo(user).head.commit.hexsha == old_head


def test_a_fast_forward_git_refuses_anyway_leaves_orig_head_as_it_was(tmp_path: Path, upstream: Upstream) -> None:
    """A stale index.lock (a crashed editor) makes git refuse after it has written ORIG_HEAD."""
    user, old_head = stale_checkout(tmp_path, upstream)
    (user / ".git" / "index.lock").write_text("")
    before = user_state(user)

    res = resolve_reference("speculators", path=user)

    assert user_state(user) == before
    assert "git refused the fast-forward" in tier(res, "git-pull").reason
    assert res.tier == "git-pull" and git.Repo(user).head.commit.hexsha == old_head


def test_a_safe_fast_forward_still_happens(tmp_path: Path, upstream: Upstream) -> None:
    user, old_head = stale_checkout(tmp_path, upstream)
    res = resolve_reference("speculators", path=user)
    assert "fast-forwarded main" in tier(res, "git-pull").reason
    assert (user / NEEDED[1]).read_bytes() == stand_in(NEEDED[1], 2)


# --- other odd states through the CLI --------------------------------------------------------------------

def dirty(tmp_path: Path, upstream: Upstream) -> Path:
    user, _ = stale_checkout(tmp_path, upstream)
    (user / NEEDED[0]).write_text("# my edit\n")
    return user


def detached(tmp_path: Path, upstream: Upstream) -> Path:
    user, old_head = stale_checkout(tmp_path, upstream)
    git.Repo(user).git.checkout("--detach", old_head)
    return user


def no_commits(tmp_path: Path, upstream: Upstream) -> Path:
    user = tmp_path / "empty"
    git.Repo.init(user, initial_branch="main").create_remote("origin", upstream.url)
    return user


def mid_merge(tmp_path: Path, upstream: Upstream) -> Path:
    user, old_head = stale_checkout(tmp_path, upstream)
    (user / ".git" / "MERGE_HEAD").write_text(old_head + "\n")
    return user


@pytest.mark.parametrize("make", [dirty, detached, no_commits, mid_merge])
def test_odd_checkouts_are_left_exactly_as_they_were(tmp_path: Path, upstream: Upstream, make) -> None:
    user = make(tmp_path, upstream)
    before = user_state(user)
    code, out, err, exc = invoke(["fetch-reference", "speculators", "--path", str(user), "--json"])
    assert exc is None and "Traceback" not in out + err
    assert code in (0, 1)
    json.loads(out)
    assert user_state(user) == before


def test_a_path_that_is_not_a_checkout_is_one_line(tmp_path: Path, upstream: Upstream) -> None:
    (tmp_path / "plain").mkdir()
    code, out, err, exc = invoke(["fetch-reference", "speculators", "--path", str(tmp_path / "plain")])
    assert exc is None
    assert "is not a git checkout" in assert_one_line_error(err, code)


# --- a token in the remote URL ----------------------------------------------------------------------------

def test_a_token_in_the_remote_url_is_written_nowhere(tmp_path: Path, upstream: Upstream,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    user, _ = stale_checkout(tmp_path, upstream)
    repo = git.Repo(user)
    repo.git.remote("set-url", "origin", f"https://x-access-token:{SECRET}@github.com/vllm-project/speculators.git")
    with repo.config_writer() as config:  # so the fetch fails at once on this machine, without a network
        config.set_value("http", "proxy", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("GITHUB_TOKEN", "ghp_" + "E" * 36)
    code_file = tmp_path / "drafter.py"
    code_file.write_text("BLOCK_SIZE = 8\n")
    out_dir = tmp_path / "diagnosis"

    outputs = []
    for args in (["fetch-reference", "speculators", "--path", str(user)],
                 ["fetch-reference", "speculators", "--path", str(user), "--json"],
                 ["diagnose", "--code", str(code_file), "--reference-path", str(user), "--out", str(out_dir)],
                 ["diagnose", "--code", str(code_file), "--reference-path", str(user), "--out", str(out_dir),
                  "--format", "json"]):
        code, out, err, exc = invoke(args)
        assert exc is None, args
        outputs.append(out + err)

    fetch_text = outputs[0]
    assert "github.com" in fetch_text  # the host is still named, only the secret goes
    for text in outputs:
        assert SECRET not in text and "E" * 36 not in text
    assert {"report.md", "report.json", "trace.jsonl"} <= {p.name for p in out_dir.iterdir()}
    for secret in (SECRET, "E" * 36):
        assert_no_secret_under(secret, out_dir, tmp_path / "cache")


@pytest.mark.parametrize("text, secret", [
    ("fetch origin (https://x-access-token:SEKRET1234@github.com/o/r.git) main", "SEKRET1234"),
    ("https://SEKRET1234@github.com/o/r.git", "SEKRET1234"),
    ("https://h.test/p?a=1&access_token=SEKRET1234&b=2", "SEKRET1234"),
    ("https://h.test/p?sig=SEKRET1234", "SEKRET1234"),
    ("Authorization: Bearer SEKRET1234", "SEKRET1234"),
    ("token ghp_" + "A1b2" * 9 + " leaked", "ghp_" + "A1b2" * 9),
    ("github_pat_" + "x" * 30, "github_pat_" + "x" * 30),
])
def test_redact_takes_the_secret_and_keeps_the_host(text: str, secret: str) -> None:
    from sleuth.redact import redact

    assert secret not in redact(text)
    assert redact(redact(text)) == redact(text)
    if "github.com" in text:
        assert "github.com/o/r.git" in redact(text)


def test_redact_leaves_ordinary_text_and_ssh_remotes_alone() -> None:
    from sleuth.redact import redact

    for text in ("git@github.com:vllm-project/speculators.git", "the token representations are fine",
                 "https://github.com/vllm-project/speculators.git", "src/speculators/models/dflash/core.py:17"):
        assert redact(text) == text
