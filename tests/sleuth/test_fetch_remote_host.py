"""A user's checkout whose remote is a network host the reference does not name is never fetched: a fork
or a mirror would otherwise be reported as the reference."""

from __future__ import annotations

from pathlib import Path

import git
import pytest
import respx

from sleuth.reference import resolve_reference
from sleuth.reference.local import remote_host


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("https://github.com/vllm-project/speculators.git", "github.com"),
        ("git@github.com:vllm-project/speculators.git", "github.com"),
        ("ssh://git@mirror.example.test/speculators.git", "mirror.example.test"),
        ("/srv/git/speculators.git", None),
        ("file:///srv/git/speculators.git", None),
        ("../speculators", None),
    ],
)
def test_remote_host(url: str, host: str | None) -> None:
    assert remote_host(url) == host


def test_a_checkout_tracking_another_host_is_not_fetched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLEUTH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("SLEUTH_PLAYBOOKS_DIR", raising=False)
    repo = git.Repo.init(tmp_path / "checkout", initial_branch="main")
    (tmp_path / "checkout" / "README.md").write_text("a stale checkout\n")
    repo.index.add(["README.md"])
    repo.index.commit("stale")
    repo.create_remote("origin", "https://mirror.example.test/speculators.git")
    head_before = repo.head.commit.hexsha

    with respx.mock(assert_all_called=False):  # any HTTP attempt fails inside the raw/docs tiers
        resolution = resolve_reference("speculators", path=tmp_path / "checkout")

    pull = next(a for a in resolution.trace if a.tier == "git-pull")
    assert pull.outcome == "skipped"
    assert "mirror.example.test, not among the reference's allowed hosts" in pull.reason
    assert repo.head.commit.hexsha == head_before
    assert not list(repo.refs)[1:]  # no remote-tracking refs: nothing was fetched
