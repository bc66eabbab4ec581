"""The `docs` tier: the reference's documentation pages, kept as pages.

Docs describe intent, not the code that ran, so findings built on them carry lower confidence; they are
returned in `Resolution.docs`, never mixed with source files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sleuth.reference.http import FetchFailure, HttpPolicy, get, truncation_problem

if TYPE_CHECKING:
    import httpx


@dataclass
class DocsResult:
    found: dict[str, bytes] = field(default_factory=dict)  # final URL -> body
    failures: dict[str, str] = field(default_factory=dict)


def fetch_docs(client: httpx.Client, urls: list[str], *, allowed_hosts: list[str], deadline: float,
               policy: HttpPolicy) -> DocsResult:
    result = DocsResult()
    for url in urls:
        try:
            response = get(client, url, allowed_hosts=allowed_hosts, deadline=deadline, policy=policy)
        except FetchFailure as exc:
            result.failures[url] = str(exc)
            continue
        truncated = truncation_problem(response)
        if truncated:
            result.failures[url] = truncated
        elif not response.content.strip():
            result.failures[url] = "empty page"
        else:
            result.found[url] = response.content
    return result
