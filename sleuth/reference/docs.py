"""The `docs` tier: the reference's documentation pages, kept as pages.

Docs describe intent, not the code that ran, so findings built on them carry lower confidence; they are
returned in `Resolution.docs`, never mixed with source files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sleuth.reference.http import FetchFailure, HttpPolicy, get

if TYPE_CHECKING:
    import httpx


@dataclass
class DocsResult:
    found: dict[str, bytes] = field(default_factory=dict)  # final URL -> body
    failures: dict[str, str] = field(default_factory=dict)


def fetch_docs(client: httpx.Client, urls: list[str], *, allowed_hosts: list[str], deadline: float,
               policy: HttpPolicy, unreachable: set[str] | None = None) -> DocsResult:
    """Each page complete (Content-Length, gzip trailer; checked while reading) and not empty."""
    result = DocsResult()
    for url in urls:
        try:
            body = get(client, url, allowed_hosts=allowed_hosts, deadline=deadline, policy=policy,
                       unreachable=unreachable)
        except FetchFailure as exc:
            result.failures[url] = str(exc)
            continue
        if not body.content.strip():
            result.failures[url] = "empty page (HTTP 200 with no content)"
        else:
            result.found[url] = body.content
    return result
