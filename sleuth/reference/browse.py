"""Reading a resolved reference beyond its needed files: list, read and search at the resolved commit.

`open_view` resolves the reference through the chain (the same tiers, hosts and `offline` rule as
`sleuth fetch-reference`), then finds a git repository that holds the resolved commit: the user's checkout
(--path, SLEUTH_<NAME>_PATH, config file) or sleuth's own cache clone. With one, any file of the commit can
be listed and read from git objects; without one (the raw tier answered, or a cache snapshot), a file the
definition does not list is fetched through the chain again, pinned to the commit. Every answer names the
commit, so a line quoted from it is `path:line@commit`. Fetched code is read as text, never imported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from sleuth.reference.cache import ReferenceCache, sha256_hex
from sleuth.reference.chain import resolve_reference
from sleuth.reference.config import cache_root, configured_checkout
from sleuth.reference.model import SOURCE_TIERS, ReferenceError, Resolution
from sleuth.reference.playbook import load_reference_spec

if TYPE_CHECKING:
    from sleuth.reference.local import GitCheckout

# An agent reads files of a repository, not data dumps: larger files and longer answers are cut, and say so.
MAX_FILE_BYTES = 2 * 1024 * 1024
MAX_LINES_PER_READ = 2000
MAX_LISTED = 5000
MAX_SEARCHED_FILES = 500
MAX_MATCHES = 200
MAX_PATTERN = 300
_MAX_MATCH_LINE = 400


@dataclass
class ReferenceView:
    """A resolution plus the git repository (if any) that holds its commit."""

    name: str
    resolution: Resolution
    checkout: GitCheckout | None = None
    offline: bool = False
    checkout_path: Path | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def commit(self) -> str | None:
        return self.resolution.commit if self.resolution.tier in SOURCE_TIERS else None


@dataclass
class ListedFiles:
    paths: list[str]
    how: str
    truncated: bool = False


@dataclass
class FileSlice:
    path: str
    commit: str
    tier: str
    source: str
    sha256: str
    start: int
    end: int
    total_lines: int
    text: str
    truncated: bool

    @property
    def provenance(self) -> str:
        lines = f"{self.start}" if self.start == self.end else f"{self.start}-{self.end}"
        return f"{self.path}:{lines}@{self.commit[:7]}"


@dataclass
class Match:
    path: str
    line: int
    text: str

    def provenance(self, commit: str) -> str:
        return f"{self.path}:{self.line}@{commit[:7]}"


@dataclass
class SearchResult:
    matches: list[Match]
    files_searched: int
    scope: list[str]
    truncated: bool
    notes: list[str] = field(default_factory=list)


def check_repo_path(path: str, *, what: str = "path") -> str:
    """A repository-relative path: no absolute path, no `..`, no control character; `/`-separated."""
    text = (path or "").strip().strip("/")
    if (not isinstance(path, str) or len(path) > 1000 or path.startswith("/") or "\\" in path
            or any(ord(c) < 32 or ord(c) == 127 for c in path)
            or ".." in PurePosixPath(text).parts or re.match(r"^[A-Za-z]:", text)):
        raise ReferenceError(f"{what} {path!r} is not a path inside the repository (relative, no '..')")
    return text


def check_pattern(pattern: str, *, regex: bool) -> re.Pattern[str] | None:
    """The compiled pattern (regex), None for a plain string; ReferenceError for an unusable one."""
    if not pattern or len(pattern) > MAX_PATTERN:
        raise ReferenceError(f"pattern must be 1 to {MAX_PATTERN} characters")
    if not regex:
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ReferenceError(f"pattern {pattern!r} is not a valid regular expression: {exc}") from None


def open_view(name: str, *, ref: str | None = None, path: Path | None = None, offline: bool = False,
              cache_dir: Path | None = None) -> ReferenceView:
    """Resolve `name` through the chain and find a git repository holding the resolved commit."""
    resolution = resolve_reference(name, ref=ref, path=path, offline=offline, cache_dir=cache_dir)
    view = ReferenceView(name=name, resolution=resolution, offline=offline, checkout_path=path)
    if view.commit is None:
        return view
    from sleuth.reference.local import GitCheckout, GitFailure, open_cache_clone

    spec = load_reference_spec(name)
    choice = configured_checkout(name, path)
    candidates = []
    try:
        if choice is not None:
            candidates.append(GitCheckout(choice.path, offline=offline, allowed_hosts=spec.allowed_hosts))
        clone = open_cache_clone(ReferenceCache(cache_root(cache_dir), name).clone_dir, spec.url, offline=offline,
                                 create=False, allowed_hosts=spec.allowed_hosts)
        if clone is not None:
            candidates.append(clone)
    except (ReferenceError, GitFailure):
        pass  # the chain already answered; without a repository the files come through it again
    for checkout in candidates:
        if checkout.rev(view.commit) == view.commit:
            view.checkout = checkout
            break
    return view


def list_files(view: ReferenceView, under: str | None = None) -> ListedFiles:
    """The files of the resolved commit under `under` (the whole tree when None)."""
    prefix = check_repo_path(under, what="path") if under else ""
    commit = view.commit
    if commit is None:
        return ListedFiles([], f"no source tier answered (tier: {view.resolution.tier or 'none'}): no files to list")
    if view.checkout is not None:
        from sleuth.reference.local import GitFailure

        try:
            # Trees only: a partial clone has every tree, so this never fetches a blob.
            listed = str(view.checkout.run("ls-tree", "-r", "--name-only", "--full-tree", commit, "--",
                                           *([prefix] if prefix else [])))
        except GitFailure as exc:
            raise ReferenceError(f"cannot list {view.name} at {commit[:7]}: {exc}") from None
        paths = [p for p in listed.splitlines() if p]
        how = f"git tree of {commit[:7]} in {view.checkout.path}"
    else:
        paths = [f.path for f in view.resolution.files if _under(f.path, prefix)]
        how = (f"the {len(view.resolution.files)} files the reference definition lists, from the "
               f"{view.resolution.tier} tier (no git repository holds {commit[:7]} here, so its tree is not listed)")
    return ListedFiles(paths[:MAX_LISTED], how, truncated=len(paths) > MAX_LISTED)


def _under(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix.rstrip("/") + "/")


def read_bytes(view: ReferenceView, path: str) -> tuple[bytes, str, str]:
    """(bytes, tier, source) of `path` at the resolved commit; ReferenceError when it is not there."""
    path = check_repo_path(path)
    commit = view.commit
    if commit is None:
        raise ReferenceError(f"{view.name}: no source tier answered (tier: {view.resolution.tier or 'none'}); "
                             "there is no commit to read files at")
    resolved = view.resolution.file(path)
    if resolved is not None and view.checkout is None:
        # The chain's own copy (a cache snapshot, the raw tier): its text, as the chain decoded it.
        return resolved.text.encode("utf-8"), resolved.tier, resolved.source
    if view.checkout is not None:  # git objects: the exact bytes of the commit
        from sleuth.reference.local import GitFailure

        try:
            if path not in view.checkout.present(commit, [path]):
                raise ReferenceError(f"{path} is not a file of {view.name} at {commit[:7]}")
            data = view.checkout.read(commit, path)
            return data, view.resolution.tier or "local", f"git object {commit[:7]}:{path} in {view.checkout.path}"
        except GitFailure as exc:
            view.notes.append(f"{path}: git could not read it ({exc}); tried the chain at {commit[:7]}")
    # No repository holds the commit (raw tier, cache snapshot): the same chain, pinned to the commit.
    single = resolve_reference(view.name, ref=commit, path=view.checkout_path, offline=view.offline, needed=[path])
    found = single.file(path) if single.has_source and single.commit == commit else None
    if found is None:
        why = "; ".join(f"{a.tier}: {a.reason}" for a in single.trace if a.outcome not in ("ok", "skipped"))
        raise ReferenceError(f"{path} could not be read from {view.name} at {commit[:7]}" + (f" ({why})" if why else ""))
    return found.text.encode("utf-8"), found.tier, found.source


def read_file(view: ReferenceView, path: str, start: int | None = None, end: int | None = None) -> FileSlice:
    """Lines `start`..`end` (1-based, inclusive) of `path` at the resolved commit."""
    data, tier, source = read_bytes(view, path)
    path = check_repo_path(path)
    if len(data) > MAX_FILE_BYTES:
        raise ReferenceError(f"{path} is {len(data)} bytes, over the {MAX_FILE_BYTES}-byte limit for reading")
    if b"\0" in data[:8192]:
        raise ReferenceError(f"{path} is a binary file")
    lines = data.decode("utf-8", errors="replace").splitlines()
    total = len(lines)
    first = 1 if start is None else start
    last = total if end is None else min(end, total)
    if first < 1 or (end is not None and end < first):
        raise ReferenceError(f"lines {start}..{end}: start must be >= 1 and end >= start")
    if total and first > total:
        raise ReferenceError(f"{path} has {total} lines; line {first} is past its end")
    truncated = last - first + 1 > MAX_LINES_PER_READ
    if truncated:
        last = first + MAX_LINES_PER_READ - 1
    chosen = lines[first - 1:last]
    return FileSlice(path=path, commit=view.commit or "", tier=tier, source=source, sha256=sha256_hex(data),
                     start=first if total else 0, end=last if total else 0, total_lines=total,
                     text="\n".join(chosen), truncated=truncated)


def search(view: ReferenceView, pattern: str, *, under: str | None = None, regex: bool = False) -> SearchResult:
    """Lines matching `pattern` (a plain string, or a Python regex with `regex`) at the resolved commit.

    Scope: `under` when given; else the reference definition's files and module directories (what the
    playbook reads), so a partial clone never fetches the whole repository for one search.
    """
    compiled = check_pattern(pattern, regex=regex)
    if compiled is not None:
        def hit(line: str) -> bool:
            return compiled.search(line) is not None
    else:
        def hit(line: str) -> bool:
            return pattern in line

    if view.commit is None:
        raise ReferenceError(f"{view.name}: no source tier answered (tier: {view.resolution.tier or 'none'}); "
                             "there is no commit to search")
    spec = load_reference_spec(view.name)
    scope = [check_repo_path(under)] if under else sorted({*spec.module_dirs, *spec.files})
    paths: list[str] = []
    for part in scope:
        for listed in list_files(view, part).paths:
            if listed not in paths:
                paths.append(listed)
    notes: list[str] = []
    if len(paths) > MAX_SEARCHED_FILES:
        notes.append(f"{len(paths)} files in scope; searched the first {MAX_SEARCHED_FILES}")
        paths = paths[:MAX_SEARCHED_FILES]
    matches: list[Match] = []
    searched = 0
    truncated = False
    for path in paths:
        try:
            data, _, _ = read_bytes(view, path)
        except ReferenceError as exc:
            notes.append(str(exc))
            continue
        if len(data) > MAX_FILE_BYTES or b"\0" in data[:8192]:
            continue  # binary or huge: not source text
        searched += 1
        for number, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
            if hit(line[:4000]):
                matches.append(Match(path=path, line=number, text=line.strip()[:_MAX_MATCH_LINE]))
                if len(matches) >= MAX_MATCHES:
                    truncated = True
                    break
        if truncated:
            break
    return SearchResult(matches=matches, files_searched=searched, scope=scope, truncated=truncated,
                        notes=notes + view.notes)
