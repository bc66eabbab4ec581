"""A reference checkout's git configuration is code: every way it names a program, and a caller's GIT_* variables.

Each attack is a real repository a user might be handed: its `.git/config` (or a committed `.gitattributes`)
names a program that writes a marker file when run; the checkout is one commit behind its upstream, so sleuth
fetches and fast-forwards it (the calls where git would run hooks, filters, upload-pack and fsmonitor). Through
`sleuth fetch-reference --path` and `sleuth diagnose --reference-path` alike: the marker never appears and the
answer is still right (the upstream's commit, fast-forwarded). A caller's GIT_DIR naming another repository
leaves that repository byte-identical; someone else's checkout is read, never written.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import git
import pytest
import respx
from sleuth_helpers import NEEDED, Upstream, invoke, isolate, stand_in, user_state

ALLOWED = ["github.com", "api.github.com", "raw.githubusercontent.com"]


@pytest.fixture(autouse=True)
def no_real_http():
    with respx.mock(assert_all_called=False) as mock:
        mock.route(host="api.github.com").respond(404)
        mock.route(host="raw.githubusercontent.com").respond(404)
        yield mock


@pytest.fixture()
def upstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Upstream:
    up = Upstream(tmp_path)
    isolate(tmp_path, monkeypatch, url=up.url, allowed_hosts=ALLOWED)
    up.commit({"README.md": b"stand-in\n", ".gitattributes": b"*.py filter=evil\n"}, "before DFlash")
    up.commit({p: stand_in(p) for p in NEEDED}, "add DFlash")
    return up


def program(path: Path, marker: Path, then: str = "") -> str:
    """A shell script that leaves `marker` behind when anything runs it."""
    path.write_text(f"#!/bin/sh\necho ran >> '{marker}'\n{then}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


def behind(tmp_path: Path, upstream: Upstream) -> tuple[Path, str]:
    """A clean clone tracking origin/main, one commit behind it: sleuth fetches and fast-forwards it."""
    user = tmp_path / "user"
    upstream.clone(user)
    newer = upstream.commit({p: stand_in(p, 2) for p in NEEDED}, "v2")
    return user, newer


def plant_fsmonitor(user: Path, marker: Path) -> None:
    with git.Repo(user).config_writer() as config:
        config.set_value("core", "fsmonitor", program(user.parent / "fsmonitor.sh", marker))


def plant_hooks(user: Path, marker: Path) -> None:
    hooks = user / ".git" / "hooks"
    for name in ("post-merge", "reference-transaction", "post-checkout", "pre-auto-gc", "post-rewrite"):
        program(hooks / name, marker)


def plant_hooks_path(user: Path, marker: Path) -> None:
    """The same hooks elsewhere, named by core.hooksPath in the repository's config."""
    elsewhere = user.parent / "their-hooks"
    elsewhere.mkdir()
    plant_hooks_in(elsewhere, marker)
    with git.Repo(user).config_writer() as config:
        config.set_value("core", "hooksPath", str(elsewhere))


def plant_hooks_in(folder: Path, marker: Path) -> None:
    for name in ("post-merge", "reference-transaction", "post-checkout"):
        program(folder / name, marker)


def plant_upload_pack(user: Path, marker: Path) -> None:
    script = program(user.parent / "uploadpack.sh", marker, 'exec git-upload-pack "$@"')
    with git.Repo(user).config_writer() as config:
        config.set_value('remote "origin"', "uploadpack", script)


def plant_filter(user: Path, marker: Path) -> None:
    """The committed .gitattributes names filter `evil`; the config defines it as programs (and as required)."""
    script = program(user.parent / "filter.sh", marker, "cat")
    with git.Repo(user).config_writer() as config:
        config.set_value('filter "evil"', "smudge", script)
        config.set_value('filter "evil"', "clean", script)
        config.set_value('filter "evil"', "required", "true")


def plant_process_filter(user: Path, marker: Path) -> None:
    script = program(user.parent / "process.sh", marker, "exit 1")
    with git.Repo(user).config_writer() as config:
        config.set_value('filter "evil"', "process", script)


def plant_unused_filter(user: Path, marker: Path) -> None:
    """A driver no attribute names (git-lfs installed globally, a repository without LFS files): it runs
    nothing and stops nothing; the fast-forward still happens."""
    script = program(user.parent / "lfs.sh", marker, "cat")
    with git.Repo(user).config_writer() as config:
        config.set_value('filter "lfs"', "smudge", script)
        config.set_value('filter "lfs"', "process", script)
        config.set_value('filter "lfs"', "required", "true")


def plant_ssh_and_askpass(user: Path, marker: Path) -> None:
    script = program(user.parent / "anything.sh", marker)
    with git.Repo(user).config_writer() as config:
        config.set_value("core", "sshCommand", script)
        config.set_value("core", "askPass", script)
        config.set_value("credential", "helper", f"!{script}")
        config.set_value("merge", "verifySignatures", "true")
        config.set_value("gpg", "program", script)
        config.set_value("core", "alternateRefsCommand", script)
        config.set_value("log", "showSignature", "true")


ATTACKS = [plant_fsmonitor, plant_hooks, plant_hooks_path, plant_upload_pack, plant_filter, plant_process_filter,
           plant_unused_filter, plant_ssh_and_askpass]


def run_cli(command: str, user: Path, tmp_path: Path) -> tuple[int, str]:
    if command == "fetch-reference":
        code, out, err, exc = invoke(["fetch-reference", "speculators", "--path", str(user), "--json"])
        assert exc is None, err
        return code, out
    code_file = tmp_path / "drafter.py"
    code_file.write_text("BLOCK_SIZE = 8\n")
    out_dir = tmp_path / "diagnosis"
    code, out, err, exc = invoke(["diagnose", "--code", str(code_file), "--reference-path", str(user),
                                  "--out", str(out_dir), "--format", "json"])
    assert exc is None and "Traceback" not in err, err
    return code, (out_dir / "report.json").read_text()


def reference_text(command: str, text: str) -> str:
    """What the command says of the reference it resolved (the commit is in it when it was fetched)."""
    data = json.loads(text)
    return json.dumps(data if command == "fetch-reference" else data.get("reference") or {})


@pytest.mark.parametrize("command", ["fetch-reference", "diagnose"])
@pytest.mark.parametrize("plant", ATTACKS, ids=lambda f: f.__name__.removeprefix("plant_"))
def test_the_checkouts_config_runs_nothing_and_the_answer_is_still_right(tmp_path: Path, upstream: Upstream,
                                                                        plant, command: str) -> None:
    user, newer = behind(tmp_path, upstream)
    marker = tmp_path / "MARKER"
    plant(user, marker)

    code, text = run_cli(command, user, tmp_path)

    assert not marker.exists(), f"{plant.__name__}: {marker.read_text()!r}"
    assert newer in reference_text(command, text), text[:2000]
    if plant in (plant_filter, plant_process_filter):
        # No filter runs, so no fast-forward either (it would leave unfiltered bytes in the work tree): the
        # files are read from the fetched objects and the checkout is left as it was.
        assert git.Repo(user).head.commit.hexsha != newer
        assert "is under a filter driver, which sleuth does not run" in text
    else:
        # The fast-forward happened (git's own checkout, no hook): the working tree is the upstream's bytes.
        assert git.Repo(user).head.commit.hexsha == newer
        assert (user / NEEDED[1]).read_bytes() == stand_in(NEEDED[1], 2)


@pytest.mark.parametrize("command", ["fetch-reference", "diagnose"])
def test_a_callers_git_dir_leaves_that_repository_untouched(tmp_path: Path, upstream: Upstream, command: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    user, newer = behind(tmp_path, upstream)
    other = tmp_path / "other"
    upstream.clone(other)
    other_repo = git.Repo(other)
    other_repo.git.checkout("-b", "mine", "HEAD~1")  # on a branch of its own, behind: a fast-forward would show
    before = user_state(other)
    status_before = other_repo.git.status("--porcelain")
    for name, value in {"GIT_DIR": other / ".git", "GIT_WORK_TREE": other, "GIT_INDEX_FILE": other / ".git" / "index",
                        "GIT_OBJECT_DIRECTORY": other / ".git" / "objects", "GIT_CEILING_DIRECTORIES": "/",
                        "GIT_CONFIG_COUNT": "1", "GIT_CONFIG_KEY_0": "core.hooksPath",
                        "GIT_CONFIG_VALUE_0": str(tmp_path)}.items():
        monkeypatch.setenv(name, str(value))

    code, text = run_cli(command, user, tmp_path)
    for name in ("GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_OBJECT_DIRECTORY", "GIT_CEILING_DIRECTORIES",
                 "GIT_CONFIG_COUNT", "GIT_CONFIG_KEY_0", "GIT_CONFIG_VALUE_0"):
        monkeypatch.delenv(name)

    assert user_state(other) == before
    assert git.Repo(other).git.status("--porcelain") == status_before
    assert newer in reference_text(command, text)
    assert git.Repo(user).head.commit.hexsha == newer


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a checkout to another user needs root")
def test_someone_elses_checkout_is_read_never_fetched_into(tmp_path: Path, upstream: Upstream) -> None:
    user, newer = behind(tmp_path, upstream)
    old_head = git.Repo(user).head.commit.hexsha
    for path in [user, *user.rglob("*")]:
        os.chown(path, 65534, 65534, follow_symlinks=False)
    before = user_state(user)

    code, text = run_cli("fetch-reference", user, tmp_path)

    assert user_state(user) == before
    assert not (user / ".git" / "refs" / "remotes" / "origin" / "main").exists() or \
        (user / ".git" / "refs" / "remotes" / "origin" / "main").read_text().strip() != newer
    data = json.loads(text)
    assert data["commit"] == old_head and data["tier"] == "local"  # read: its HEAD's files, from objects
    pull = next(a for a in data["trace"] if a["tier"] == "git-pull")
    assert pull["outcome"] == "skipped" and "belongs to uid 65534" in pull["reason"]


def test_a_dot_git_file_naming_another_repository_leaves_that_one_untouched(tmp_path: Path,
                                                                            upstream: Upstream) -> None:
    """A checkout whose `.git` is a file pointing at the user's other repository: git would move that one's
    branch and index. It is read (its HEAD's files), never fetched into or fast-forwarded."""
    victim, _ = behind(tmp_path, upstream)
    before = user_state(victim)
    handed = tmp_path / "handed"
    handed.mkdir()
    (handed / ".git").write_text(f"gitdir: {victim / '.git'}\n")

    code, text = run_cli("fetch-reference", handed, tmp_path)

    assert user_state(victim) == before
    data = json.loads(text)
    pull = next(a for a in data["trace"] if a["tier"] == "git-pull")
    assert pull["outcome"] == "skipped" and "lies outside" in pull["reason"], pull


@pytest.mark.parametrize("how", ["url", "insteadOf"])
def test_a_remote_url_that_is_a_command_is_never_run(tmp_path: Path, upstream: Upstream, how: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`ext::` runs its URL as a command line; the protocol allow-list has no ext, whatever the config says.
    The host rule is opened to "ext" here so that the allow-list alone stands between."""
    isolate(tmp_path, monkeypatch, url=upstream.url, allowed_hosts=[*ALLOWED, "ext"])
    user, _ = behind(tmp_path, upstream)
    marker = tmp_path / "MARKER"
    script = program(tmp_path / "ext.sh", marker, "exit 1")
    with git.Repo(user).config_writer() as config:
        config.set_value("protocol", "allow", "always")
        config.set_value('protocol "ext"', "allow", "always")
        if how == "url":
            config.set_value('remote "origin"', "url", f"ext::{script}")
        else:
            config.set_value(f'url "ext::{script} "', "insteadOf", upstream.url)
        config.set_value('remote "origin"', "promisor", "true")
        config.set_value("extensions", "partialclone", "origin")
    before = user_state(user)

    code, text = run_cli("fetch-reference", user, tmp_path)

    assert not marker.exists()
    assert user_state(user) == before
