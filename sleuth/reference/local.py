"""The git tiers: `local` (a checkout's HEAD) and `git-pull` (fetch, then fast-forward or read objects).

The user's checkout is theirs. We read files from git objects (never the working tree, whose edits have no
commit to cite), fetch only into remote-tracking refs, and change their branch only by a fast-forward that
is provably safe: clean tree and index, HEAD on the branch that tracks the fetched upstream, no merge or
rebase in progress, and the upstream a descendant of HEAD. Otherwise the files come from the fetched
objects and the checkout is left as it was. Every git call goes through sleuth.reference.gitsafe.run_git:
non-interactive, time-bounded, with a scrubbed environment, and with the repository's own configuration
unable to run anything (hooks, fsmonitor, filters, upload-pack, helpers). A checkout someone else owns, or
one whose `.git` file names a git directory outside it, is read and never written.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from sleuth.redact import redact
from sleuth.reference.gitsafe import GIT_TIMEOUT_S, TRUSTED_UPLOAD_PACK, GitFailure, owned_by_someone_else, run_git
from sleuth.reference.model import ReferenceError

__all__ = ["GIT_TIMEOUT_S", "GitCheckout", "GitFailure", "looks_like_sha", "open_cache_clone", "pull"]

_SHA_RE = re.compile(r"^[0-9a-fA-F]{7,40}$")


def looks_like_sha(ref: str | None) -> bool:
    return bool(ref and _SHA_RE.match(ref))


def locate_repository(path: Path) -> tuple[Path, Path | None] | None:
    """(git dir, work tree or None when bare) of the repository at `path`, found without running git and
    without searching parent directories; None when `path` is no repository."""
    path = Path(os.path.abspath(path))
    dot_git = path / ".git"
    if dot_git.is_dir():
        return dot_git, path
    if dot_git.is_file():  # a linked worktree or a submodule: "gitdir: PATH"
        try:
            first = dot_git.read_text(encoding="utf-8", errors="replace")[:4096].splitlines()[0]
        except (OSError, IndexError):
            return None
        if first.startswith("gitdir:"):
            target = Path(first[len("gitdir:"):].strip())
            git_dir = target if target.is_absolute() else path / target
            if (git_dir / "HEAD").is_file():
                return Path(os.path.abspath(git_dir)), path
        return None
    if (path / "HEAD").is_file() and (path / "objects").is_dir() and (path / "refs").is_dir():
        return path, None  # a bare repository (the cache clone), or a .git directory named directly
    return None


def _inside(path: Path, root: Path) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


class GitCheckout:
    """A thin, time-bounded wrapper over one repository (a user checkout or the cache's bare clone); every git
    command goes through gitsafe.run_git (see there for what a repository's configuration can no longer do)."""

    def __init__(self, path: Path, *, offline: bool, is_cache: bool = False,
                 allowed_hosts: list[str] | None = None) -> None:
        self.path = Path(path)
        self.offline = offline
        self.is_cache = is_cache
        self.allowed_hosts = [h.lower() for h in allowed_hosts or []]
        found = locate_repository(self.path)
        if found is None:
            raise ReferenceError(f"{self.path} is not a git checkout")
        self.git_dir, self.work_tree = found
        if self.work_tree is None and self.git_dir.name == ".git":
            self.work_tree = self.git_dir.parent
        # git's safe.directory rule: a repository someone else owns is theirs; it is read (its configuration
        # can run nothing here), never fetched into or fast-forwarded.
        self.foreign_owner = None if is_cache else owned_by_someone_else(
            *filter(None, [self.work_tree, self.git_dir]))
        # Why this repository is read only (None: it may be fetched into and fast-forwarded). A `.git` file
        # can name any git directory (a linked worktree's, or another repository of the user's): moving
        # that one's branch would change a repository nobody handed to sleuth.
        self.read_only: str | None = None
        if self.foreign_owner is not None:
            self.read_only = f"{self.path} belongs to uid {self.foreign_owner}, not to you"
        elif self.work_tree is not None and not _inside(self.git_dir, self.work_tree):
            self.read_only = f"its git directory {self.git_dir} lies outside {self.path} (a .git file)"
        # Every call starts without network; network is allowed only once every remote that git could
        # contact on its own (a partial clone's promisor remotes) is known to be on an allowed host.
        self.network = False
        self.filter_overrides: list[tuple[str, str]] = []
        self.filter_overrides = self._filter_overrides()
        self.network_refusal = "--offline" if offline else self._promisor_refusal()
        if self.network_refusal is None:
            self.network = True

    def _filter_overrides(self) -> list[tuple[str, str]]:
        """Every filter driver any configuration names, emptied: git then checks out and hashes the bytes as
        they are (an empty smudge/clean/process is no filter; required=false keeps an emptied one legal)."""
        try:
            keys = str(self.run("config", "--name-only", "--get-regexp", r"^filter\.")).splitlines()
        except GitFailure:
            return []  # exit 1: no filter configured
        names = {key[len("filter."):].rsplit(".", 1)[0] for key in keys if key.count(".") >= 2}
        return [(f"filter.{name}.{field}", "false" if field == "required" else "")
                for name in sorted(names) for field in ("smudge", "clean", "process", "required")]

    def _promisor_refusal(self) -> str | None:
        """Why git may not reach a network from this repository, or None when it may."""
        for remote in self.promisor_remotes():
            url = self.remote_url(remote)
            if url == "?":
                return f"promisor remote {remote} has no URL"
            host = remote_host(url)
            if host is not None and host.lower() not in self.allowed_hosts:
                return f"promisor remote {remote} is on host {host}, not among the reference's allowed hosts"
        return None

    def promisor_remotes(self) -> list[str]:
        """The remotes git fetches missing objects from by itself (partial clones): never contacted unchecked."""
        names: list[str] = []
        try:
            listed = str(self.run("config", "--get-regexp", r"^remote\..*\.promisor$"))
        except GitFailure:
            listed = ""  # exit 1: no such key
        for line in listed.splitlines():
            key, _, value = line.partition(" ")
            if value.strip().lower() in ("true", "yes", "on", "1"):
                names.append(key[len("remote."):-len(".promisor")])
        try:
            names.append(str(self.run("config", "--get", "extensions.partialclone")).strip())
        except GitFailure:
            pass
        return list(dict.fromkeys(n for n in names if n))

    # low level ----------------------------------------------------------------------------------------
    def run(self, *args: str, binary: bool = False, timeout: float = GIT_TIMEOUT_S) -> str | bytes:
        return run_git(list(args), git_dir=self.git_dir, work_tree=self.work_tree, network=self.network,
                       binary=binary, timeout=timeout, extra_config=self.filter_overrides,
                       safe_directory=Path("*") if self.foreign_owner is not None else None)

    def rev(self, revision: str) -> str | None:
        try:
            return str(self.run("rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}"))
        except GitFailure:
            return None

    def is_ancestor(self, older: str, newer: str) -> bool:
        try:
            self.run("merge-base", "--is-ancestor", older, newer)
            return True
        except GitFailure:
            return False

    def present(self, commit: str, paths: list[str]) -> set[str]:
        listed = str(self.run("ls-tree", "-r", "--name-only", commit, "--", *paths))
        return set(listed.splitlines()) & set(paths)

    def read(self, commit: str, path: str) -> bytes:
        return bytes(self.run("cat-file", "blob", f"{commit}:{path}", binary=True))

    def first_commit_adding(self, commit: str, directory: str) -> str | None:
        """The oldest commit reachable from `commit` that added a file under `directory`."""
        out = str(self.run("log", "--no-show-signature", "--diff-filter=A", "--format=%H", "--reverse", commit,
                           "--", directory))
        lines = out.split()
        return lines[0] if lines else None

    # state --------------------------------------------------------------------------------------------
    @property
    def branch(self) -> str | None:
        try:
            ref = str(self.run("symbolic-ref", "-q", "HEAD")).strip()
        except GitFailure:
            return None  # detached (or no HEAD at all)
        return ref.removeprefix("refs/heads/") if ref.startswith("refs/heads/") else None

    def _config(self, key: str) -> str | None:
        try:
            return str(self.run("config", "--get", key)).strip()
        except GitFailure:
            return None  # exit 1: not set

    def tracking(self) -> tuple[str, str] | None:
        """(remote, branch) the current branch tracks, from the branch's own config."""
        branch = self.branch
        if branch is None:
            return None
        remote, merge = self._config(f"branch.{branch}.remote"), self._config(f"branch.{branch}.merge")
        if not remote or not merge or remote == ".":  # tracks a local branch: there is no upstream to fetch
            return None
        return remote, merge.removeprefix("refs/heads/")

    def remote_names(self) -> list[str]:
        try:
            return [name for name in str(self.run("remote")).splitlines() if name.strip()]
        except GitFailure:
            return []

    def remote_url(self, remote: str) -> str:
        """The URL git would contact (insteadOf applied), userinfo redacted: it is printed and written."""
        try:
            return redact(str(self.run("remote", "get-url", remote)))
        except GitFailure:
            return "?"

    def is_shallow(self) -> bool:
        return (self.git_dir / "shallow").is_file()

    def dirty_reason(self) -> str | None:
        git_dir = self.git_dir
        for marker, what in (
            ("MERGE_HEAD", "a merge"),
            ("rebase-merge", "a rebase"),
            ("rebase-apply", "a rebase"),
            ("CHERRY_PICK_HEAD", "a cherry-pick"),
            ("REVERT_HEAD", "a revert"),
        ):
            if (git_dir / marker).exists():
                return f"{what} is in progress"
        # `git status` honours GIT_OPTIONAL_LOCKS=0 and so never rewrites the user's index; `git diff`
        # may refresh and write it, which would break our promise.
        try:
            status = str(self.run("status", "--porcelain", "--untracked-files=no"))
        except GitFailure as exc:
            return f"cannot tell whether the working tree is clean ({exc})"
        if status.strip():
            return "the working tree or index has uncommitted changes"
        return None

    def paths_in_the_way(self, target: str) -> list[str]:
        """Files the fast-forward to `target` would create but that already exist untracked (or ignored,
        which git overwrites silently): the user's, so the fast-forward is not done."""
        added = str(self.run("diff", "-z", "--name-only", "--no-renames", "--no-ext-diff", "--no-textconv",
                             "--diff-filter=A", "HEAD", target, "--"))
        work_tree = self.work_tree or self.path
        in_the_way = []
        for relative in filter(None, added.split("\0")):  # -z: names as they are, never quoted
            path = work_tree / relative
            parents = [p for p in path.relative_to(work_tree).parents if str(p) != "."]
            if os.path.lexists(path) or any((work_tree / p).exists() and not (work_tree / p).is_dir()
                                            for p in parents):
                in_the_way.append(relative)
        return in_the_way

    def filtered_paths(self, older: str, newer: str) -> list[str]:
        """Paths a checkout from `older` to `newer` writes that a configured filter driver would process (or
        a .gitattributes that could name one); empty when no filter driver is configured at all."""
        if not self.filter_overrides:
            return []
        changed = [p for p in str(self.run("diff", "-z", "--name-only", "--no-renames", "--no-ext-diff",
                                           "--no-textconv", older, newer, "--")).split("\0") if p]
        named = [p for p in changed if p.rsplit("/", 1)[-1] == ".gitattributes"]
        if named or not changed:
            return named
        drivers = {key.split(".", 1)[1].rsplit(".", 1)[0] for key, _ in self.filter_overrides}
        # check-attr reads attributes only (work tree, info/attributes); it runs nothing.
        listed = str(self.run("check-attr", "-z", "filter", "--", *changed)).split("\0")
        return [path for path, value in zip(listed[0::3], listed[2::3]) if value in drivers]

    def fast_forward(self, target: str) -> None:
        """`git merge --ff-only target`, leaving ORIG_HEAD as it was if git refuses after all."""
        orig_head = self.git_dir / "ORIG_HEAD"
        before = orig_head.read_bytes() if orig_head.is_file() else None
        try:
            self.run("merge", "--ff-only", "--quiet", target)
        except GitFailure:
            # git writes ORIG_HEAD before it tries; a refused merge must leave no trace in the checkout.
            if before is None:
                orig_head.unlink(missing_ok=True)
            elif not orig_head.is_file() or orig_head.read_bytes() != before:
                orig_head.write_bytes(before)
            raise

    def fetch(self, remote: str, branch: str) -> None:
        if self.network_refusal is not None:
            raise GitFailure(f"not fetched: {self.network_refusal}")
        if self.read_only is not None:
            raise GitFailure(f"not fetched: {self.read_only}")
        # An explicit upload-pack: remote.*.uploadpack in the repository's config is a command line.
        args = ["fetch", "--no-tags", "--no-write-fetch-head", "--quiet", "--no-recurse-submodules",
                f"--upload-pack={TRUSTED_UPLOAD_PACK}"]
        if self.is_cache:
            args.append("--filter=blob:none")
        self.run(*args, remote, f"+refs/heads/{branch}:refs/remotes/{remote}/{branch}")


def open_cache_clone(clone_dir: Path, url: str, *, offline: bool, create: bool,
                     allowed_hosts: list[str] | None = None) -> GitCheckout | None:
    """The tool's own bare partial clone; created (empty, remote configured) only when `create`."""
    if not (clone_dir / "HEAD").is_file():
        if not create:
            return None
        shutil.rmtree(clone_dir, ignore_errors=True)
        clone_dir.parent.mkdir(parents=True, exist_ok=True)
        # No template: a template directory (GIT_TEMPLATE_DIR, init.templateDir) would bring hooks with it.
        try:
            run_git(["init", "--bare", "--quiet", "--template=", str(clone_dir)], git_dir=None, work_tree=None,
                    network=False, cwd=clone_dir.parent)
        except GitFailure as exc:
            raise ReferenceError(f"cannot create the cache clone {clone_dir}: {exc}") from None
    checkout = GitCheckout(clone_dir, offline=offline, is_cache=True, allowed_hosts=allowed_hosts)
    if create:
        if "origin" in checkout.remote_names():
            checkout.run("remote", "set-url", "origin", url)
        else:
            checkout.run("remote", "add", "origin", url)
        # Mark origin as a promisor so blobs left out by --filter=blob:none are fetched when read.
        checkout.run("config", "remote.origin.promisor", "true")
        checkout.run("config", "remote.origin.partialclonefilter", "blob:none")
        # Reopened, so the network rule is decided on the remote just configured.
        checkout = GitCheckout(clone_dir, offline=offline, is_cache=True, allowed_hosts=allowed_hosts)
    return checkout


@dataclass
class LocalState:
    """What one commit of a checkout holds of the needed files."""

    checkout: GitCheckout
    commit: str | None
    label: str
    present: set[str] = field(default_factory=set)
    missing: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.commit is not None and not self.missing


def inspect_checkout(checkout: GitCheckout, needed: list[str], ref: str | None, default_branch: str) -> LocalState:
    """Which needed files the checkout holds at HEAD (or at --ref), from git objects, without touching it."""
    if checkout.is_cache:
        revision = ref or f"refs/remotes/origin/{default_branch}"
        candidates = [revision, f"refs/remotes/origin/{ref}"] if ref else [revision]
        where = f"cache clone {checkout.path}"
    else:
        candidates = [ref, *(f"refs/remotes/{r}/{ref}" for r in checkout.remote_names())] if ref else ["HEAD"]
        where = f"checkout {checkout.path}"
    commit = next((c for c in (checkout.rev(r) for r in candidates) if c), None)
    if commit is None:
        what = f"--ref {ref}" if ref else ("no fetched branch yet" if checkout.is_cache else "no commits")
        return LocalState(checkout, None, f"{where}: {what}", set(), list(needed))
    on = "detached HEAD" if not checkout.is_cache and checkout.branch is None else (checkout.branch or "")
    label = f"{where} at {commit[:7]}" + (f" ({on})" if on and not ref and not checkout.is_cache else "")
    present = checkout.present(commit, needed)
    return LocalState(checkout, commit, label, present, [p for p in needed if p not in present])


def describe_missing(missing: list[str], module_dirs: list[str], needed: list[str]) -> list[str]:
    """Name whole missing module directories rather than listing every file in them."""
    named: list[str] = []
    covered: set[str] = set()
    for directory in module_dirs:
        prefix = directory.rstrip("/") + "/"
        wanted = [p for p in needed if p.startswith(prefix)]
        if wanted and all(p in missing for p in wanted):
            named.append(prefix)
            covered.update(wanted)
    return named + [p for p in missing if p not in covered]


@dataclass
class PullResult:
    outcome: str  # Attempt outcome
    reason: str
    commit: str | None = None  # the commit to read the files from; None -> keep the local result
    source: str = ""
    notes: list[str] = field(default_factory=list)
    use_local: bool = False
    up_to_date: bool = False  # the local commit is exactly the fetched upstream
    branch: str | None = None  # the upstream branch that was fetched


def remote_host(url: str) -> str | None:
    """The network host of a git remote URL (https://, ssh://, git://, or scp-like user@host:path);
    None for a local path or file:// URL."""
    if "://" in url:
        parts = urlsplit(url)
        return None if parts.scheme == "file" else parts.hostname
    scp_like = re.match(r"^(?:[^@/]+@)?([^:/]+):(?!/)", url)
    return scp_like.group(1) if scp_like else None


# How long a TCP connection to the remote may take before the host counts as unreachable. git's own
# https transport (curl) waits up to 300 s to connect; a user behind a firewall would wait that long.
CONNECT_PROBE_S = 3.0
_PROXY_ENV = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def unreachable_reason(checkout: GitCheckout, url: str, unreachable: set[str] | None) -> str | None:
    """Why the remote's host cannot be connected to (no DNS, no route, refused, silent), found in at most
    CONNECT_PROBE_S; None when it can, or when a proxy stands between (then git's own errors apply)."""
    import socket

    parts = urlsplit(url) if "://" in url else None
    if parts is None or parts.scheme not in ("https", "http") or not parts.hostname:
        return None  # ssh remotes are bounded by GIT_SSH_COMMAND's ConnectTimeout; local paths need no network
    if any(os.environ.get(var) for var in _PROXY_ENV) or _git_proxy_configured(checkout):
        return None
    host = parts.hostname.lower()
    if unreachable is not None and host in unreachable:
        return f"{host} could not be reached earlier"
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with socket.create_connection((host, port), timeout=CONNECT_PROBE_S):
            return None
    except (OSError, ValueError) as exc:
        if unreachable is not None:
            unreachable.add(host)
        return f"cannot connect to {host} ({getattr(exc, 'strerror', None) or exc or type(exc).__name__})"


def _git_proxy_configured(checkout: GitCheckout) -> bool:
    try:
        return bool(str(checkout.run("config", "--get-regexp", r"^(http\..*proxy|remote\..*\.proxy)$")).strip())
    except GitFailure:
        return False  # exit 1: no proxy setting


def choose_upstream(checkout: GitCheckout, ref: str | None, default_branch: str,
                    repository: str) -> tuple[str, str] | None:
    """(remote, branch) to fetch: the branch's own upstream when it has one and no other --ref was asked."""
    tracking = checkout.tracking()
    if tracking and (ref is None or ref == checkout.branch or ref == tracking[1]):
        return tracking
    remotes = checkout.remote_names()
    if not remotes:
        return None
    matching = [r for r in remotes if repository.lower() in checkout.remote_url(r).lower()]
    remote = matching[0] if matching else ("origin" if "origin" in remotes else remotes[0])
    branch = ref if ref and not looks_like_sha(ref) else default_branch
    return remote, branch


def pull(state: LocalState, needed: list[str], ref: str | None, default_branch: str, repository: str,
         module_dirs: list[str], allowed_hosts: list[str] | None = None,
         unreachable: set[str] | None = None) -> PullResult:
    """Fetch the upstream, then decide: local is current, fast-forward, or read the fetched objects."""
    checkout = state.checkout
    upstream = choose_upstream(checkout, ref, default_branch, repository)
    if upstream is None:
        return PullResult("miss", "the checkout has no remote to fetch from", use_local=state.complete)
    remote, branch = upstream
    if checkout.read_only is not None:
        # git's safe.directory reasoning: someone else's repository is read, never written.
        return PullResult("skipped", f"{checkout.read_only}: read, never fetched into or fast-forwarded",
                          use_local=state.complete)
    host = remote_host(checkout.remote_url(remote))
    if host is not None and allowed_hosts is not None and host.lower() not in {h.lower() for h in allowed_hosts}:
        # A network remote the reference does not name: a fork or a mirror would be reported as the
        # reference, so it is not fetched (local paths and file:// remotes are the user's own copies).
        return PullResult(
            "skipped",
            f"remote {remote} is on host {host}, not among the reference's allowed hosts; not fetched",
            use_local=state.complete,
        )
    url = checkout.remote_url(remote)
    refusal = checkout.network_refusal or unreachable_reason(checkout, url, unreachable)
    if refusal is not None:
        return PullResult("error", f"fetch {remote} ({url}) {branch}: not tried: {refusal}", use_local=state.complete)
    try:
        checkout.fetch(remote, branch)
    except GitFailure as exc:
        return PullResult("error", f"fetch {remote} ({url}) {branch}: {exc}", use_local=state.complete)
    result = _pull_fetched(state, needed, ref, remote, branch, module_dirs)
    result.branch = branch
    return result


def _pull_fetched(state: LocalState, needed: list[str], ref: str | None, remote: str, branch: str,
                  module_dirs: list[str]) -> PullResult:
    checkout = state.checkout
    remote_ref = f"refs/remotes/{remote}/{branch}"
    upstream_commit = checkout.rev(remote_ref)
    if upstream_commit is None:
        return PullResult("error", f"{remote}/{branch} did not resolve after the fetch", use_local=state.complete)
    target = upstream_commit
    if looks_like_sha(ref):
        target = checkout.rev(ref)  # type: ignore[arg-type]
        if target is None:
            return PullResult("miss", f"commit {ref} is not in {remote}/{branch} either", use_local=False)
    where = f"{remote}/{branch} at {target[:7]}"
    subject = "the cache clone" if checkout.is_cache else "checkout"
    if state.complete and state.commit == target:
        return PullResult("ok", f"{subject} is up to date with {where}; nothing to pull", use_local=True,
                          up_to_date=True)
    if state.complete and not looks_like_sha(ref) and checkout.is_ancestor(target, state.commit or ""):
        return PullResult("ok", f"{subject} is ahead of {where}; using its HEAD", use_local=True)

    present = checkout.present(target, needed)
    lacking = [p for p in needed if p not in present]
    if lacking:
        names = ", ".join(describe_missing(lacking, module_dirs, needed))
        return PullResult("miss", f"{where} lacks {names}", use_local=state.complete)

    notes = stale_notes(state, target, needed, module_dirs)
    if checkout.is_cache:
        return PullResult("ok", f"cache clone fetched {where}", target,
                          f"git object {{commit}}:{{path}} in {checkout.path}", notes)

    why_not = why_not_fast_forward(checkout, ref, remote, branch, target)
    if why_not is None:
        before = checkout.rev("HEAD") or "?"
        try:
            checkout.fast_forward(target)
        except GitFailure as exc:
            why_not = f"git refused the fast-forward ({exc})"
        else:
            return PullResult(
                "ok", f"fast-forwarded {checkout.branch} {before[:7]}..{target[:7]} from {remote}/{branch}",
                target, f"{checkout.path}:{{path}} at {{commit}}", notes,
            )
    return PullResult(
        "ok",
        f"left your checkout untouched ({why_not}); read the files from fetched {where}",
        target, f"git object {{commit}}:{{path}} in {checkout.path}", notes,
    )


def why_not_fast_forward(checkout: GitCheckout, ref: str | None, remote: str, branch: str, target: str) -> str | None:
    if checkout.branch is None:
        return "HEAD is detached"
    if ref is not None and ref != checkout.branch:
        return f"--ref {ref} is not the checked-out branch"
    if checkout.tracking() != (remote, branch):
        return f"branch {checkout.branch} does not track {remote}/{branch}"
    filtered = checkout.filtered_paths("HEAD", target)
    if filtered:
        # sleuth runs no filter driver (git-lfs's included): checking these out unfiltered would leave other
        # bytes (LFS pointers) in your work tree than git would.
        return f"{filtered[0]} is under a filter driver, which sleuth does not run"
    dirty = checkout.dirty_reason()
    if dirty:
        return dirty
    if not checkout.is_ancestor("HEAD", target):
        return f"branch {checkout.branch} has diverged from {remote}/{branch}"
    in_the_way = checkout.paths_in_the_way(target)
    if in_the_way:
        more = f" and {len(in_the_way) - 1} more" if len(in_the_way) > 1 else ""
        return f"the fast-forward would overwrite your untracked {in_the_way[0]}{more}"
    return None


def stale_notes(state: LocalState, target: str, needed: list[str], module_dirs: list[str]) -> list[str]:
    """'checkout at de03273 has no src/.../dflash/; upstream has it since f324209', per missing dir."""
    if state.commit is None or not state.missing:
        return []
    checkout = state.checkout
    shallow = " (earliest commit in this shallow history)" if checkout.is_shallow() else ""
    notes = []
    for name in describe_missing(state.missing, module_dirs, needed):
        try:
            first = checkout.first_commit_adding(target, name)
        except GitFailure:
            first = None
        since = f"; upstream has it since {first[:7]}{shallow}" if first else ""
        notes.append(f"checkout at {state.commit[:7]} has no {name}{since}")
    return notes
