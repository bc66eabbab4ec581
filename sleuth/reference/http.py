"""One careful GET for the HTTP tiers: allowlisted hosts, bounded retries, Retry-After, no HTML tree pages.

Retries cover what is worth retrying (429, 5xx, timeouts, dropped connections) with exponential backoff,
and honour Retry-After; the whole tier shares one deadline so a slow host cannot stall a diagnosis.
The optional GITHUB_TOKEN goes only to GitHub's API and raw hosts and never into a message or a file.
"""

from __future__ import annotations

import email.utils
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

if TYPE_CHECKING:
    import httpx

TOKEN_ENV = "GITHUB_TOKEN"
TOKEN_HOSTS = frozenset({"api.github.com", "raw.githubusercontent.com"})
USER_AGENT = "sleuth-fetch-reference"

# Indirections so tests can run the retry logic without waiting in real time.
sleep = time.sleep
monotonic = time.monotonic


@dataclass(frozen=True)
class HttpPolicy:
    request_timeout_s: float = 20.0
    total_timeout_s: float = 90.0  # one budget for a whole tier
    max_attempts: int = 4
    backoff_s: float = 0.5
    max_redirects: int = 5


class FetchFailure(Exception):
    """Why a URL gave nothing usable; one line, safe to print (no headers, no token)."""


def new_client(policy: HttpPolicy) -> httpx.Client:
    import httpx

    return httpx.Client(timeout=policy.request_timeout_s, follow_redirects=False,
                        headers={"User-Agent": USER_AGENT})


def _auth_headers(host: str) -> dict[str, str]:
    token = os.environ.get(TOKEN_ENV, "").strip()
    return {"Authorization": f"Bearer {token}"} if token and host in TOKEN_HOSTS else {}


def check_url(url: str, allowed_hosts: list[str]) -> str:
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if parts.scheme != "https":
        raise FetchFailure(f"refusing non-https URL {url}")
    if host not in {h.lower() for h in allowed_hosts}:
        raise FetchFailure(f"host {host} is not in the reference's allowlist")
    segments = parts.path.split("/")
    if host == "github.com" and len(segments) > 3 and segments[3] in {"tree", "blob"}:
        # GitHub's HTML tree and blob pages are crawled badly and change shape; never scrape them.
        raise FetchFailure(f"refusing GitHub HTML page {url}; use raw.githubusercontent.com")
    return host


def _retry_after_s(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def get(client: httpx.Client, url: str, *, allowed_hosts: list[str], deadline: float, policy: HttpPolicy,
        headers: dict[str, str] | None = None) -> httpx.Response:
    """GET `url` and return a 200 response, or raise FetchFailure with the reason."""
    import httpx

    last_reason = "no attempt made"
    redirects = 0
    attempt = 0
    while attempt < policy.max_attempts:
        host = check_url(url, allowed_hosts)
        remaining = deadline - monotonic()
        if remaining <= 0:
            raise FetchFailure(f"time bound reached ({last_reason})")
        attempt += 1
        wait: float | None = None
        try:
            response = client.get(url, headers={**(headers or {}), **_auth_headers(host)},
                                  timeout=min(policy.request_timeout_s, remaining))
        except httpx.TimeoutException:
            last_reason = "timed out"
        except httpx.TransportError as exc:
            last_reason = f"connection failed ({type(exc).__name__})"
        else:
            status = response.status_code
            if status == 200:
                return response
            if status in (301, 302, 303, 307, 308) and "location" in response.headers:
                redirects += 1
                if redirects > policy.max_redirects:
                    raise FetchFailure("too many redirects")
                url = urljoin(url, response.headers["location"])
                attempt -= 1  # a redirect is not a failed attempt
                continue
            if status == 429 or status >= 500:
                last_reason = f"HTTP {status}"
                wait = _retry_after_s(response)
            else:
                raise FetchFailure(f"HTTP {status}")
        if attempt >= policy.max_attempts:
            break
        if wait is None:
            wait = policy.backoff_s * 2 ** (attempt - 1)
        if monotonic() + wait > deadline:
            raise FetchFailure(f"{last_reason}; retrying after {wait:.0f}s would pass the time bound")
        sleep(wait)
    raise FetchFailure(f"{last_reason} after {attempt} attempts")


def truncation_problem(response: httpx.Response) -> str | None:
    """Why the body is shorter than the server said, or None.

    Content-Length counts the bytes on the wire, which are compressed when the server gzips the reply (raw
    GitHub does), so it is compared with what was downloaded, not with the decoded body.
    """
    declared = response.headers.get("Content-Length")
    if declared is None or not declared.isdigit():
        return None
    # num_bytes_downloaded counts the wire bytes of a streamed reply; a reply built in memory (a transport
    # that hands over the body whole) has none, and then the body is the wire unless it is encoded.
    received = response.num_bytes_downloaded
    if not received:
        if response.headers.get("Content-Encoding", "identity").lower() not in ("", "identity"):
            return None  # the wire size is unknown; the body's own checks (HTML, parses) still apply
        received = len(response.content)
    if int(declared) != received:
        return f"truncated: {received} of {declared} bytes"
    return None
