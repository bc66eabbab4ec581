"""The git tiers against real repositories built here: a bare upstream and clones in every awkward state.

The stand-in files at the speculators paths are our own few lines; the history mirrors the real story
(a commit that predates DFlash, then the commit that adds the module). After every run the user's files,
index, branches, tags, HEAD and config must be byte-identical unless a fast-forward was safe.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import git
import pytest
import respx
import typer
from typer.testing import CliRunner

from sleuth.commands.fetch_reference import fetch_reference
from sleuth.reference import resolve_reference

DFLASH = "src/speculators/models/dflash/"
NEEDED = [
    DFLASH + "__init__.py",
    DFLASH + "attention.py",
    DFLASH + "core.py",
    "src/speculators/losses/utils.py",
    "docs/user_guide/algorithms/dflash.md",
]

PLAYBOOK = """\
repository: vllm-project/speculators
url: {url}
default_branch: main
files: {files}
module_dirs: [src/speculators/models/dflash/, src/speculators/losses/]
docs:
  - url: https://docs.example.test/dflash/
allowed_hosts: [api.github.com, raw.githubusercontent.com, docs.example.test]
pinned_commit: {pinned}
pinned:
  dflash.loss_decay_gamma: {{expected: 4.0, location: src/speculators/losses/utils.py:1-2}}
"""

PINNED = "c" * 40


@pytest.fixture(autouse=True)
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SLEUTH_CONFIG_FILE", str(tmp_path / "no-config.yaml"))
    monkeypatch.delenv("SLEUTH_SPECULATORS_PATH", raising=False)
    monkeypatch.delenv("GITHUB_TOKEN", raising=False)
    for var in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
        monkeypatch.setenv(var, "Test")
    for var in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(var, "test@example.test")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


@pytest.fixture(autouse=True)
def no_real_http():
    """Any HTTP tier reached in these tests sees GitHub and the docs host answer 404, never the network."""
    with respx.mock(assert_all_called=False) as mock:
        mock.route(host="api.github.com").respond(404)
        mock.route(host="raw.githubusercontent.com").respond(404)
        mock.route(host="docs.example.test").respond(404)
        yield mock


class Upstream:
    """A bare upstream plus a work repo that writes its history; commits are pushed on demand."""

    def __init__(self, root: Path) -> None:
        self.bare_dir = root / "upstream.git"
        self.bare = git.Repo.init(self.bare_dir, bare=True, initial_branch="main")
        self.work = git.Repo.init(root / "author", initial_branch="main")
        self.work.create_remote("origin", self.bare_dir.as_uri())
        self.url = self.bare_dir.as_uri()
        self.commits: dict[str, str] = {}

    def commit(self, label: str, files: dict[str, str], message: str) -> str:
        for path, text in files.items():
            target = Path(self.work.working_tree_dir) / path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            self.work.index.add([path])
        sha = self.work.index.commit(message).hexsha
        self.work.git.push("origin", "main")
        self.commits[label] = sha
        return sha

    def clone(self, dest: Path, *args: str) -> git.Repo:
        git.Repo.clone_from(self.url, dest, multi_options=list(args) or None)
        return git.Repo(dest)


def stand_in(path: str, version: int = 1) -> str:
    if path.endswith(".md"):
        return f"# DFlash stand-in page v{version}\n"
    return f'"""Stand-in for {path}, version {version}."""\nVERSION = {version}\n'


@pytest.fixture()
def upstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Upstream:
    up = Upstream(tmp_path)
    up.commit("pre_dflash", {"README.md": "speculators stand-in\n", "src/speculators/__init__.py": ""},
              "bump vllm to latest version (#294)")
    playbooks = tmp_path / "playbooks"
    (playbooks / "references").mkdir(parents=True)
    (playbooks / "references" / "speculators.yaml").write_text(
        PLAYBOOK.format(url=up.url, files=json.dumps(NEEDED), pinned=PINNED))
    monkeypatch.setenv("SLEUTH_PLAYBOOKS_DIR", str(playbooks))
    return up


def add_dflash(up: Upstream, version: int = 1) -> str:
    return up.commit(f"dflash_v{version}", {p: stand_in(p, version) for p in NEEDED},
                     "[Feat]Add DFlash training support (#354)" if version == 1 else f"update dflash v{version}")


def user_state(repo_dir: Path) -> dict[str, bytes | str]:
    """Everything of the user's we promise not to touch: files, index, HEAD, local branches, tags, config."""
    repo = git.Repo(repo_dir)
    state: dict[str, bytes | str] = {}
    for file in sorted(repo_dir.rglob("*")):
        if file.is_file() and ".git" not in file.relative_to(repo_dir).parts:
            state[f"file:{file.relative_to(repo_dir)}"] = file.read_bytes()
    git_dir = Path(repo.git_dir)
    for name in ("index", "HEAD", "config", "shallow"):
        if (git_dir / name).exists():
            state[f"git:{name}"] = (git_dir / name).read_bytes()
    state["refs"] = repo.git.for_each_ref("refs/heads", "refs/tags", format="%(refname) %(objectname)")
    return state


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def by_tier(resolution, tier: str):
    return [a for a in resolution.trace if a.tier == tier]


# -- the scenarios ---------------------------------------------------------------------------------------


def test_up_to_date_checkout_is_used_as_is(upstream: Upstream, tmp_path: Path) -> None:
    head = add_dflash(upstream)
    upstream.clone(tmp_path / "user")
    before = user_state(tmp_path / "user")

    res = resolve_reference("speculators", path=tmp_path / "user")

    assert res.tier == "local" and res.commit == head
    assert [f.path for f in res.files] == NEEDED
    assert all(f.sha256 == sha256(stand_in(f.path)) and f.commit == head for f in res.files)
    assert by_tier(res, "git-pull")[0].outcome == "ok" and "up to date" in by_tier(res, "git-pull")[0].reason
    assert user_state(tmp_path / "user") == before


def test_stale_checkout_is_named_then_fast_forwarded(upstream: Upstream, tmp_path: Path) -> None:
    user = upstream.clone(tmp_path / "user")  # predates DFlash, like de03273
    stale = upstream.commits["pre_dflash"]
    added = add_dflash(upstream)

    res = resolve_reference("speculators", path=tmp_path / "user")

    local = by_tier(res, "local")[0]
    assert local.outcome == "miss"
    assert local.reason == (f"checkout at {stale[:7]} has no {DFLASH}, src/speculators/losses/, "
                            "docs/user_guide/algorithms/dflash.md")
    assert f"checkout at {stale[:7]} has no {DFLASH}; upstream has it since {added[:7]}" in res.notes
    pull = by_tier(res, "git-pull")[0]
    assert pull.outcome == "ok" and pull.reason.startswith(f"fast-forwarded main {stale[:7]}..{added[:7]}")
    assert res.tier == "git-pull" and res.commit == added
    assert user.head.commit.hexsha == added  # the safe fast-forward happened
    assert (tmp_path / "user" / DFLASH / "core.py").read_text() == stand_in(DFLASH + "core.py")
    # the checkout, then the cache snapshot (none yet), then the fetch; the later tiers are not needed
    assert [a.tier for a in res.trace] == ["local", "local", "git-pull", "raw", "docs", "pinned"]
    assert by_tier(res, "local")[1].reason == "nothing cached yet"
    assert [a.outcome for a in res.trace[3:]] == ["skipped"] * 3


def test_stale_module_named_at_the_first_commit_that_added_it(upstream: Upstream, tmp_path: Path) -> None:
    upstream.clone(tmp_path / "user")
    first = add_dflash(upstream, 1)
    add_dflash(upstream, 2)  # later edits must not move "since"

    res = resolve_reference("speculators", path=tmp_path / "user")

    stale = upstream.commits["pre_dflash"][:7]
    assert f"checkout at {stale} has no {DFLASH}; upstream has it since {first[:7]}" in res.notes
    assert res.file(DFLASH + "core.py").text == stand_in(DFLASH + "core.py", 2)


def test_dirty_tree_is_left_alone_and_files_come_from_fetched_objects(upstream: Upstream, tmp_path: Path) -> None:
    add_dflash(upstream, 1)
    upstream.clone(tmp_path / "user")
    newer = add_dflash(upstream, 2)
    (tmp_path / "user" / DFLASH / "core.py").write_text("# my local experiment\n")  # unstaged edit
    (tmp_path / "user" / "notes.txt").write_text("staged\n")
    git.Repo(tmp_path / "user").index.add(["notes.txt"])  # and a staged file
    before = user_state(tmp_path / "user")

    res = resolve_reference("speculators", path=tmp_path / "user")

    pull = by_tier(res, "git-pull")[0]
    assert "left your checkout untouched (the working tree or index has uncommitted changes)" in pull.reason
    assert res.tier == "git-pull" and res.commit == newer
    assert res.file(DFLASH + "core.py").text == stand_in(DFLASH + "core.py", 2)  # not the user's edit
    assert user_state(tmp_path / "user") == before
    # the fetch landed in the remote-tracking ref only
    assert git.Repo(tmp_path / "user").git.rev_parse("refs/remotes/origin/main") == newer


def test_diverged_branch_is_not_touched(upstream: Upstream, tmp_path: Path) -> None:
    add_dflash(upstream, 1)
    user = upstream.clone(tmp_path / "user")
    (tmp_path / "user" / "mine.txt").write_text("local work\n")
    user.index.add(["mine.txt"])
    user.index.commit("local commit")
    newer = add_dflash(upstream, 2)
    before = user_state(tmp_path / "user")

    res = resolve_reference("speculators", path=tmp_path / "user")

    assert "branch main has diverged from origin/main" in by_tier(res, "git-pull")[0].reason
    assert res.commit == newer and res.file(DFLASH + "core.py").text == stand_in(DFLASH + "core.py", 2)
    assert user_state(tmp_path / "user") == before


def test_detached_head_is_not_touched(upstream: Upstream, tmp_path: Path) -> None:
    user = upstream.clone(tmp_path / "user")
    added = add_dflash(upstream)
    user.git.checkout("--detach")
    before = user_state(tmp_path / "user")

    res = resolve_reference("speculators", path=tmp_path / "user")

    assert by_tier(res, "local")[0].tried.endswith("(detached HEAD)")
    assert "HEAD is detached" in by_tier(res, "git-pull")[0].reason
    assert res.tier == "git-pull" and res.commit == added
    assert user_state(tmp_path / "user") == before


def test_branch_without_upstream_is_not_touched(upstream: Upstream, tmp_path: Path) -> None:
    user = upstream.clone(tmp_path / "user")
    user.git.branch("--unset-upstream")
    added = add_dflash(upstream)
    before = user_state(tmp_path / "user")

    res = resolve_reference("speculators", path=tmp_path / "user")

    assert "branch main does not track origin/main" in by_tier(res, "git-pull")[0].reason
    assert res.commit == added
    assert user_state(tmp_path / "user") == before


def test_shallow_clone_is_fetched_and_the_module_commit_named(upstream: Upstream, tmp_path: Path) -> None:
    upstream.commit("more", {"README.md": "v2\n"}, "another pre-DFlash commit")
    user = upstream.clone(tmp_path / "user", "--depth=1")
    assert (Path(user.git_dir) / "shallow").is_file()
    added = add_dflash(upstream)

    res = resolve_reference("speculators", path=tmp_path / "user")

    assert res.tier == "git-pull" and res.commit == added
    expected = f"checkout at {upstream.commits['more'][:7]} has no {DFLASH}; upstream has it since {added[:7]}"
    assert any(n.startswith(expected) for n in res.notes)
    assert all(f.sha256 == sha256(stand_in(f.path)) for f in res.files)


def test_gone_remote_keeps_a_complete_checkout(upstream: Upstream, tmp_path: Path) -> None:
    head = add_dflash(upstream)
    upstream.clone(tmp_path / "user")
    shutil.rmtree(upstream.bare_dir)
    before = user_state(tmp_path / "user")

    res = resolve_reference("speculators", path=tmp_path / "user")

    assert by_tier(res, "git-pull")[0].outcome == "error"
    assert res.tier == "local" and res.commit == head
    assert user_state(tmp_path / "user") == before


def test_gone_remote_with_stale_checkout_falls_through_to_pinned(upstream: Upstream, tmp_path: Path,
                                                                  no_real_http) -> None:
    upstream.clone(tmp_path / "user")
    shutil.rmtree(upstream.bare_dir)
    before = user_state(tmp_path / "user")

    res = resolve_reference("speculators", path=tmp_path / "user")

    assert [(a.tier, a.outcome) for a in res.trace] == [
        ("local", "miss"), ("local", "miss"), ("git-pull", "error"), ("raw", "miss"), ("docs", "miss"),
        ("pinned", "ok")]
    assert res.tier == "pinned" and res.files == [] and res.pinned["dflash.loss_decay_gamma"]["commit"] == PINNED
    assert f"checkout at {upstream.commits['pre_dflash'][:7]} has no {DFLASH}" in res.notes
    assert user_state(tmp_path / "user") == before
    assert no_real_http.calls.call_count > 0  # the raw and docs tiers really were asked


def test_no_checkout_makes_a_partial_clone_in_the_cache_then_works_offline(upstream: Upstream, tmp_path: Path) -> None:
    head = add_dflash(upstream)

    online = resolve_reference("speculators")

    assert online.tier == "git-pull" and online.commit == head
    assert "into the cache" in by_tier(online, "git-pull")[0].tried
    clone = tmp_path / "cache" / "references" / "speculators" / "git"
    assert (clone / "HEAD").is_file() and git.Repo(clone).bare
    snapshot = tmp_path / "cache" / "references" / "speculators" / "snapshots" / head
    assert (snapshot / DFLASH / "core.py").read_text() == stand_in(DFLASH + "core.py")
    assert (tmp_path / "cache" / "references" / "speculators" / "refs" / "main").read_text() == head

    offline = resolve_reference("speculators", offline=True)
    assert offline.tier == "local" and offline.commit == head
    assert [f.sha256 for f in offline.files] == [f.sha256 for f in online.files]


def test_ref_pins_a_commit_that_is_already_present(upstream: Upstream, tmp_path: Path) -> None:
    first = add_dflash(upstream, 1)
    add_dflash(upstream, 2)
    upstream.clone(tmp_path / "user")
    before = user_state(tmp_path / "user")

    res = resolve_reference("speculators", path=tmp_path / "user", ref=first[:7])

    assert res.tier == "local" and res.commit == first
    assert res.file(DFLASH + "core.py").text == stand_in(DFLASH + "core.py", 1)
    assert by_tier(res, "git-pull")[0].outcome == "skipped"
    assert user_state(tmp_path / "user") == before


def test_cli_json_for_the_stale_checkout(upstream: Upstream, tmp_path: Path) -> None:
    upstream.clone(tmp_path / "user")
    added = add_dflash(upstream)
    app = typer.Typer()
    app.command()(fetch_reference)

    result = CliRunner().invoke(app, ["speculators", "--path", str(tmp_path / "user"), "--json"])

    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["reference"] == "speculators" and payload["tier"] == "git-pull" and payload["commit"] == added
    assert {f["path"] for f in payload["files"]} == set(NEEDED)
    assert all(set(f) >= {"path", "tier", "sha256", "commit", "source", "fetched_at"} and "text" not in f
               for f in payload["files"])
    assert [t["tier"] for t in payload["trace"]] == ["local", "local", "git-pull", "raw", "docs", "pinned"]
    assert all({"tier", "tried", "outcome", "reason", "duration_s"} <= set(t) for t in payload["trace"])


def test_cli_bad_path_is_one_line_exit_2(upstream: Upstream, tmp_path: Path) -> None:
    (tmp_path / "plain").mkdir()
    app = typer.Typer()
    app.command()(fetch_reference)

    for bad in (tmp_path / "missing", tmp_path / "plain"):
        result = CliRunner().invoke(app, ["speculators", "--path", str(bad)])
        assert result.exit_code == 2
        assert "Traceback" not in result.output and len(result.stderr.strip().splitlines()) == 1
        assert str(bad) in result.stderr


def test_offline_stale_checkout_is_named_without_fetching(upstream: Upstream, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    upstream.clone(tmp_path / "user")
    add_dflash(upstream)
    before = user_state(tmp_path / "user")
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("socket opened offline"))
    monkeypatch.setattr(socket.socket, "connect", lambda *a, **k: pytest.fail("socket opened offline"))

    res = resolve_reference("speculators", path=tmp_path / "user", offline=True)

    assert f"checkout at {upstream.commits['pre_dflash'][:7]} has no {DFLASH}" in res.notes
    assert [(a.tier, a.outcome) for a in res.trace][:3] == [
        ("local", "miss"), ("local", "miss"), ("git-pull", "skipped")]
    assert res.tier == "pinned"
    assert user_state(tmp_path / "user") == before
    # offline means no fetch at all: the remote-tracking ref still points at the old commit
    assert git.Repo(tmp_path / "user").git.rev_parse("refs/remotes/origin/main") == upstream.commits["pre_dflash"]
