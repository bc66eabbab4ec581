"""The `raw` tier: exact files from raw.githubusercontent.com at a commit SHA.

The commit is resolved through the GitHub API when it answers (so every byte is tied to a SHA), else the
branch is read unpinned and the files say so (commit None). A body is accepted only if it is the file:
not an HTML page, not shorter than its Content-Length, and, for Python, it parses (parsing only: fetched
code is data, never imported or run).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sleuth.reference.http import FetchFailure, HttpPolicy, get, truncation_problem

if TYPE_CHECKING:
    import httpx

API_HOST = "https://api.github.com"
RAW_HOST = "https://raw.githubusercontent.com"
_FULL_SHA = re.compile(r"^[0-9a-f]{40}$")


def raw_url(repository: str, revision: str, path: str) -> str:
    return f"{RAW_HOST}/{repository}/{revision}/{path}"


def resolve_commit(client: httpx.Client, repository: str, revision: str, *, allowed_hosts: list[str],
                   deadline: float, policy: HttpPolicy) -> tuple[str | None, str]:
    """(full SHA or None, how it was resolved)."""
    if _FULL_SHA.match(revision.lower()):
        return revision.lower(), "given as a full SHA"
    url = f"{API_HOST}/repos/{repository}/commits/{revision}"
    try:
        response = get(client, url, allowed_hosts=allowed_hosts, deadline=deadline, policy=policy,
                       headers={"Accept": "application/vnd.github.sha"})
    except FetchFailure as exc:
        return None, f"GitHub API: {exc}"
    sha = response.text.strip().lower()
    if not _FULL_SHA.match(sha):
        return None, "GitHub API answered something other than a SHA"
    return sha, f"{revision} -> {sha[:7]} via the GitHub API"


def validate_body(path: str, response: httpx.Response) -> str | None:
    """None when the body is the file; otherwise why it is not."""
    data = response.content
    truncated = truncation_problem(response)
    if truncated:
        return truncated
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
    return None


@dataclass
class RawResult:
    commit: str | None
    revision: str
    resolved_how: str
    found: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # path -> (url, bytes)
    failures: dict[str, str] = field(default_factory=dict)  # path -> reason


def fetch_raw_files(client: httpx.Client, repository: str, revision: str, needed: list[str], *,
                    allowed_hosts: list[str], deadline: float, policy: HttpPolicy) -> RawResult:
    commit, how = resolve_commit(client, repository, revision, allowed_hosts=allowed_hosts,
                                 deadline=deadline, policy=policy)
    pinned_revision = commit or revision
    result = RawResult(commit, pinned_revision, how)
    for path in needed:
        url = raw_url(repository, pinned_revision, path)
        try:
            response = get(client, url, allowed_hosts=allowed_hosts, deadline=deadline, policy=policy)
        except FetchFailure as exc:
            result.failures[path] = str(exc)
            continue
        problem = validate_body(path, response)
        if problem:
            result.failures[path] = problem
        else:
            result.found[path] = (url, response.content)
    return result
