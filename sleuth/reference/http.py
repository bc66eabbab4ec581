"""One careful GET for the HTTP tiers: allowlisted hosts, bounded retries, Retry-After, no HTML tree pages,
bounded bodies.

Retries cover what is worth retrying (429, 5xx, timeouts, dropped connections) with exponential backoff,
and honour Retry-After; a host that cannot be connected to at all is not retried (no network: fall back
at once). The whole tier shares one deadline, checked between body chunks too, so a slow or dripping host
cannot stall a diagnosis; bodies are capped in size and in gzip inflation ratio.
The optional GITHUB_TOKEN goes only to GitHub's API and raw hosts and never into a message or a file.
"""

from __future__ import annotations

import contextvars
import email.utils
import os
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit

from sleuth.redact import redact

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
    request_timeout_s: float = 20.0  # the longest silence on one read
    connect_timeout_s: float = 5.0  # a black-holed host costs this once, then the host is skipped
    total_timeout_s: float = 90.0  # one budget for a whole tier, checked between every chunk of a body
    max_attempts: int = 4
    backoff_s: float = 0.5
    max_redirects: int = 5
    # The largest reference file is a few hundred KiB and a docs page a few MiB; anything far past that
    # is not the file. The ratio stops a small compressed body that inflates to gigabytes.
    max_body_bytes: int = 16 * 1024 * 1024
    max_inflation_ratio: float = 100.0


class FetchFailure(Exception):
    """Why a URL gave nothing usable; one line, safe to print (no headers, no token)."""

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))


class Unreachable(FetchFailure):
    """The host could not be connected to at all (no DNS, no route, refused, black-holed): not retried,
    and the host is not tried again in this resolution, so a machine without network falls back at once."""


@dataclass
class Body:
    """A complete, decoded 200 reply, read within the size, ratio and time bounds."""

    url: str
    headers: httpx.Headers
    content: bytes
    wire_bytes: int  # bytes on the wire (compressed, when the server compressed)

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


def new_client(policy: HttpPolicy) -> httpx.Client:
    import httpx

    client = httpx.Client(timeout=policy.request_timeout_s, follow_redirects=False,
                          headers={"User-Agent": USER_AGENT, "Accept-Encoding": "gzip, deflate"})
    bound_by_deadline(client)
    return client


# The deadline of the `get` running in this thread (or task): every socket read and write of its exchange
# is bounded by it, not only the body's chunks. httpx's timeouts are per read: a server that drips its status
# line or headers a byte at a time, or sends `100 Continue` forever, never trips one.
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("sleuth_http_deadline", default=None)


def _bounded(timeout: float | None, kind: str) -> float | None:
    deadline = _DEADLINE.get()
    if deadline is None:
        return timeout
    remaining = deadline - monotonic()
    if remaining <= 0:
        import httpcore

        raise {"read": httpcore.ReadTimeout, "write": httpcore.WriteTimeout,
               "connect": httpcore.ConnectTimeout}[kind]("the tier's time bound is reached")
    return remaining if timeout is None else min(timeout, remaining)


def bound_by_deadline(client: httpx.Client) -> None:
    """Make every connection of `client` (its proxies' too) answer to the deadline of the running `get`."""
    import httpcore

    class DeadlineStream(httpcore.NetworkStream):
        def __init__(self, inner: httpcore.NetworkStream) -> None:
            self._inner = inner

        def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            return self._inner.read(max_bytes, _bounded(timeout, "read"))

        def write(self, buffer: bytes, timeout: float | None = None) -> None:
            self._inner.write(buffer, _bounded(timeout, "write"))

        def close(self) -> None:
            self._inner.close()

        def start_tls(self, ssl_context, server_hostname=None, timeout=None):  # noqa: ANN001, ANN201 - httpcore's
            return DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, _bounded(timeout, "connect")))

        def get_extra_info(self, info: str):  # noqa: ANN201 - httpcore's signature
            return self._inner.get_extra_info(info)

    class DeadlineBackend(httpcore.NetworkBackend):
        def __init__(self, inner: httpcore.NetworkBackend) -> None:
            self._inner = inner

        def connect_tcp(self, host, port, timeout=None, local_address=None,  # noqa: ANN001, ANN201
                        socket_options=None):  # noqa: ANN001
            return DeadlineStream(self._inner.connect_tcp(host, port, _bounded(timeout, "connect"), local_address,
                                                          socket_options))

        def connect_unix_socket(self, path, timeout=None, socket_options=None):  # noqa: ANN001, ANN201
            return DeadlineStream(self._inner.connect_unix_socket(path, _bounded(timeout, "connect"), socket_options))

        def sleep(self, seconds: float) -> None:
            self._inner.sleep(seconds)

    transports = [getattr(client, "_transport", None), *getattr(client, "_mounts", {}).values()]
    for transport in transports:
        pool = getattr(transport, "_pool", None)
        backend = getattr(pool, "_network_backend", None)
        if backend is not None and not isinstance(backend, DeadlineBackend):
            pool._network_backend = DeadlineBackend(backend)  # type: ignore[union-attr]


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
        headers: dict[str, str] | None = None, unreachable: set[str] | None = None) -> Body:
    """GET `url` and return its complete 200 body, or raise FetchFailure with the reason.

    `unreachable` is shared by every request of one resolution: a host that could not be connected to
    is not tried again, so no network means one failed connection per host, not one per file and retry.
    """
    import httpx

    unreachable = unreachable if unreachable is not None else set()
    last_reason = "no attempt made"
    redirects = 0
    attempt = 0
    while attempt < policy.max_attempts:
        host = check_url(url, allowed_hosts)
        if host in unreachable:
            raise Unreachable(f"{host} could not be reached earlier; not tried again")
        remaining = deadline - monotonic()
        if remaining <= 0:
            raise FetchFailure(f"time bound reached ({last_reason})")
        attempt += 1
        wait: float | None = None
        timeout = httpx.Timeout(min(policy.request_timeout_s, remaining),
                                connect=min(policy.connect_timeout_s, remaining))
        try:
            answer = _exchange(client, url, {**(headers or {}), **_auth_headers(host)}, timeout, deadline, policy)
            if isinstance(answer, Body):
                return answer
            status, location, retry_after = answer
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            if isinstance(exc, httpx.ConnectTimeout) and remaining < policy.connect_timeout_s:
                raise FetchFailure(f"time bound reached while connecting to {host}") from None
            unreachable.add(host)
            raise Unreachable(f"cannot connect to {host} ({type(exc).__name__})") from None
        except httpx.TimeoutException:
            last_reason = "timed out"
        except httpx.TransportError as exc:
            last_reason = f"connection failed ({type(exc).__name__})"
        else:
            if status in (301, 302, 303, 307, 308) and location:
                redirects += 1
                if redirects > policy.max_redirects:
                    raise FetchFailure("too many redirects")
                url = urljoin(url, location)  # checked against the allowlist at the top of the loop
                attempt -= 1  # a redirect is not a failed attempt
                continue
            if status == 429 or status >= 500:
                last_reason = f"HTTP {status}"
                wait = retry_after
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


def _exchange(client: httpx.Client, url: str, headers: dict[str, str], timeout: httpx.Timeout, deadline: float,
              policy: HttpPolicy) -> Body | tuple[int, str | None, float | None]:
    """One request under the deadline (every socket read and write of it): the 200 body, or (status,
    Location, Retry-After) of any other reply."""
    bound = _DEADLINE.set(deadline)
    try:
        with client.stream("GET", url, headers=headers, timeout=timeout) as response:
            if response.status_code == 200:
                return _read_body(response, url, deadline, policy)
            return response.status_code, response.headers.get("location"), _retry_after_s(response)
    finally:
        _DEADLINE.reset(bound)


class _Inflater:
    """zlib with a cap on every step: a chunk is decoded in pieces of at most `room + 1` bytes, so a bomb
    is caught after one piece past the cap, never after inflating a whole chunk."""

    def __init__(self, encoding: str) -> None:
        codings = [c.strip() for c in encoding.split(",") if c.strip() and c.strip() != "identity"]
        if len(codings) > 1 or codings[0] not in ("gzip", "x-gzip", "deflate"):
            raise FetchFailure(f"unsupported Content-Encoding {encoding!r}")
        self._z = zlib.decompressobj(zlib.MAX_WBITS | (16 if codings[0] != "deflate" else 0))

    def pieces(self, chunk: bytes, room: int) -> Iterator[bytes]:
        data = chunk
        while True:
            try:
                # max_length 0 would mean "no limit"; pieces of at most 1 MiB let the ratio be judged early.
                piece = self._z.decompress(data, min(max(room, 0), _PIECE) + 1)
            except zlib.error:
                raise FetchFailure("the compressed body is corrupt") from None
            room -= len(piece)
            yield piece
            data = self._z.unconsumed_tail
            if not data:
                return

    @property
    def complete(self) -> bool:
        return self._z.eof


def _read_body(response: httpx.Response, url: str, deadline: float, policy: HttpPolicy) -> Body:
    """Read the body chunk by chunk, stopping at the first bound it passes: the tier's deadline (a drip
    never trips a per-read timeout), the size cap, or the inflation ratio (a gzip bomb stops after a few
    MiB, whatever it would inflate to). httpx's own decoder inflates each chunk whole, so the raw bytes
    are decoded here, capped at every step."""
    declared = response.headers.get("Content-Length", "")
    cap = policy.max_body_bytes
    if declared.isdigit() and int(declared) > cap:
        raise FetchFailure(f"body of {int(declared)} bytes is over the {cap >> 20} MiB cap")
    encoding = response.headers.get("Content-Encoding", "").strip().lower()
    inflater = _Inflater(encoding) if encoding not in ("", "identity") else None
    started = monotonic()
    wire = size = 0
    parts: list[bytes] = []
    for chunk in response.iter_raw():
        wire += len(chunk)
        for piece in (inflater.pieces(chunk, cap - size) if inflater else (chunk,)):
            size += len(piece)
            parts.append(piece)
            if size > cap:
                raise FetchFailure(f"body is over the {cap >> 20} MiB cap; not read further")
            if inflater and size > _RATIO_FLOOR and size > policy.max_inflation_ratio * wire:
                raise FetchFailure(f"compressed body inflates over {policy.max_inflation_ratio:.0f}x "
                                   f"({wire} bytes -> {size}+); refused as a decompression bomb")
        if monotonic() > deadline:
            raise FetchFailure(f"time bound reached while reading the body ({wire} bytes in "
                               f"{monotonic() - started:.0f}s)")
    if inflater and not inflater.complete:
        raise FetchFailure(f"truncated: the compressed body ends early ({wire} bytes)")
    if declared.isdigit() and int(declared) != wire:
        raise FetchFailure(f"truncated: {wire} of {declared} bytes")
    return Body(url=url, headers=response.headers, content=b"".join(parts), wire_bytes=wire)


# Below this many decoded bytes the ratio is not judged: a small, repetitive file compresses very well.
_RATIO_FLOOR = 1024 * 1024
_PIECE = 1024 * 1024
