"""The `raw` tier: exact files from raw.githubusercontent.com at a commit SHA.

The commit is resolved through the GitHub API when it answers (so every byte is tied to a SHA), else the
branch is read unpinned and the files say so (commit None). A body is accepted only if it is the file:
complete (Content-Length, gzip trailer), not empty, not an HTML page, Python that parses (parsing only:
fetched code is data, never imported or run), and, when GitHub's git tree API lists the commit's blobs,
bytes whose git blob SHA is the listed one. Only bytes checked against the tree are ever cached.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sleuth.reference.cache import git_blob_sha
from sleuth.reference.http import Body, FetchFailure, HttpPolicy, get

if TYPE_CHECKING:
    import httpx

API_HOST = "https://api.github.com"
RAW_HOST = "https://raw.githubusercontent.com"
_FULL_SHA = re.compile(r"^[0-9a-f]{40}$")
EMPTY_BLOB = "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # git's id for an empty file


def raw_url(repository: str, revision: str, path: str) -> str:
    return f"{RAW_HOST}/{repository}/{revision}/{path}"


def resolve_commit(client: httpx.Client, repository: str, revision: str, *, allowed_hosts: list[str],
                   deadline: float, policy: HttpPolicy, unreachable: set[str] | None = None) -> tuple[str | None, str]:
    """(full SHA or None, how it was resolved)."""
    if _FULL_SHA.match(revision.lower()):
        return revision.lower(), "given as a full SHA"
    url = f"{API_HOST}/repos/{repository}/commits/{revision}"
    try:
        body = get(client, url, allowed_hosts=allowed_hosts, deadline=deadline, policy=policy,
                   headers={"Accept": "application/vnd.github.sha"}, unreachable=unreachable)
    except FetchFailure as exc:
        return None, f"GitHub API: {exc}"
    sha = body.text.strip().lower()
    if not _FULL_SHA.match(sha):
        return None, "GitHub API answered something other than a SHA"
    return sha, f"{revision} -> {sha[:7]} via the GitHub API"


def expected_blobs(client: httpx.Client, repository: str, commit: str, needed: list[str], *,
                   allowed_hosts: list[str], deadline: float, policy: HttpPolicy,
                   unreachable: set[str] | None = None) -> tuple[dict[str, str], str | None]:
    """(path -> git blob SHA at `commit` for the needed paths, why not) from GitHub's git tree API.

    This is what makes a raw body trustworthy: raw.githubusercontent.com can answer 200 with an empty or
    cut body (a Python file cut at a line boundary still parses), but no cut body has the blob's SHA."""
    url = f"{API_HOST}/repos/{repository}/git/trees/{commit}?recursive=1"
    try:
        body = get(client, url, allowed_hosts=allowed_hosts, deadline=deadline, policy=policy,
                   headers={"Accept": "application/vnd.github+json"}, unreachable=unreachable)
        tree = json.loads(body.content)
    except FetchFailure as exc:
        return {}, f"GitHub tree API: {exc}"
    except ValueError:
        return {}, "GitHub tree API answered something other than JSON"
    entries = tree.get("tree") if isinstance(tree, dict) else None
    if not isinstance(entries, list):
        return {}, "GitHub tree API answered without a tree"
    wanted = set(needed)
    blobs = {
        e["path"]: e["sha"].lower() for e in entries
        if isinstance(e, dict) and e.get("path") in wanted and e.get("type") == "blob"
        and isinstance(e.get("sha"), str) and _FULL_SHA.match(e["sha"].lower())
    }
    if tree.get("truncated"):  # a very large repository: what is listed is still checked
        return blobs, "GitHub tree API listing was truncated"
    return blobs, None


def validate_body(path: str, body: Body, expected_blob: str | None = None) -> str | None:
    """None when the body is the file; otherwise why it is not.

    Framing first (Content-Length and the gzip trailer were checked while reading), then shape: not empty,
    not an HTML page, UTF-8, Python that parses. Shape alone cannot catch a file cut at a line boundary,
    so when the git tree gave the blob's SHA, the bytes must hash to it exactly."""
    data = body.content
    if not data and expected_blob != EMPTY_BLOB:
        return "empty body (HTTP 200 with 0 bytes): not the file"
    head = data[:512].lstrip().lower()
    if head.startswith((b"<!doctype html", b"<html")) or b"<head>" in head[:200]:
        return "an HTML page came back, not the file"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8 text"
    if path.endswith(".py"):
        try:
            ast.parse(text, filename=path)
        except SyntaxError as exc:
            return f"does not parse as Python (line {exc.lineno}): truncated or not the file"
        except (RecursionError, MemoryError, ValueError):
            return "cannot be parsed as Python (too deeply nested or has NUL bytes): not the file"
    if expected_blob is not None and git_blob_sha(data) != expected_blob:
        return (f"{len(data)} bytes that are not the file's blob {expected_blob[:7]} in the git tree: "
                "truncated or altered")
    return None


@dataclass
class RawResult:
    commit: str | None
    revision: str
    resolved_how: str
    found: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # path -> (url, bytes)
    failures: dict[str, str] = field(default_factory=dict)  # path -> reason
    verified: dict[str, str] = field(default_factory=dict)  # path -> git blob SHA the bytes matched
    unverified_why: str | None = None  # why the bytes could not be checked against the git tree


def fetch_raw_files(client: httpx.Client, repository: str, revision: str, needed: list[str], *,
                    allowed_hosts: list[str], deadline: float, policy: HttpPolicy,
                    unreachable: set[str] | None = None) -> RawResult:
    commit, how = resolve_commit(client, repository, revision, allowed_hosts=allowed_hosts,
                                 deadline=deadline, policy=policy, unreachable=unreachable)
    pinned_revision = commit or revision
    result = RawResult(commit, pinned_revision, how)
    blobs: dict[str, str] = {}
    if commit is not None:
        blobs, result.unverified_why = expected_blobs(client, repository, commit, needed, allowed_hosts=allowed_hosts,
                                                      deadline=deadline, policy=policy, unreachable=unreachable)
    else:
        result.unverified_why = "no commit to check the bytes against"
    for path in needed:
        url = raw_url(repository, pinned_revision, path)
        if blobs and path not in blobs and result.unverified_why is None:
            result.failures[path] = f"not a file at {pinned_revision[:7]} (the git tree does not list it)"
            continue
        try:
            body = get(client, url, allowed_hosts=allowed_hosts, deadline=deadline, policy=policy,
                       unreachable=unreachable)
        except FetchFailure as exc:
            result.failures[path] = str(exc)
            continue
        problem = validate_body(path, body, blobs.get(path))
        if problem:
            result.failures[path] = problem
        else:
            result.found[path] = (url, body.content)
            if path in blobs:
                result.verified[path] = blobs[path]
    return result
