"""The `remote` backend's HTTP client: one pooled `httpx.AsyncClient` per upstream.

httpx does the HTTP/1.1 work (keep-alive pool, Content-Length and chunked framing, a pooled connection
the upstream closed while idle replaced before use). This module adds what the backend needs on top:
bodies and stream lines read with a byte bound, and httpx's errors narrowed to two kinds the backend
maps to gateway errors.

Errors: `UpstreamUnreachable` (connect failed or took over `connect_timeout_s`, the connection broke,
a malformed answer), `UpstreamTooLong` (a body or a line passed its bound), `TimeoutError` (a
per-request timeout; the caller's own deadlines apply through asyncio timeouts as well).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Mapping
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any
from urllib.parse import urlsplit

import httpx


class UpstreamUnreachable(Exception):
    """The upstream could not be reached, or the connection broke before a whole answer came."""


class UpstreamTooLong(Exception):
    """A body or a line passed its byte bound."""


def _narrowed(exc: httpx.HTTPError, connect_timeout_s: float) -> Exception:
    """httpx's error as the one this module promises (see the module's docstring)."""
    if isinstance(exc, httpx.ConnectTimeout):
        # an upstream that cannot be reached: another route may serve, as for a refused connection
        return UpstreamUnreachable(f"connecting took over {connect_timeout_s:g} s")
    if isinstance(exc, httpx.TimeoutException):
        return TimeoutError(str(exc) or type(exc).__name__)
    return UpstreamUnreachable(f"the connection broke or the answer is malformed: {type(exc).__name__}")


class UpstreamResponse:
    """An answer whose body is still on the wire: read it with `read` or `lines`, or `aclose` it.

    Read to its end, its connection goes back to the pool; closed earlier, the connection is dropped
    (httpx never reuses a connection whose answer was left half read).
    """

    __slots__ = ("_response", "_connect_timeout_s")

    def __init__(self, response: httpx.Response, connect_timeout_s: float) -> None:
        self._response = response
        self._connect_timeout_s = connect_timeout_s

    @property
    def status(self) -> int:
        return self._response.status_code

    @property
    def headers(self) -> httpx.Headers:
        return self._response.headers

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (one piece per read off the socket, never re-buffered)."""
        if self._response.is_closed:
            return
        try:
            async for data in self._response.aiter_bytes():
                yield data
        except httpx.HTTPError as exc:
            await self._response.aclose()
            raise _narrowed(exc, self._connect_timeout_s) from None

    async def read(self, limit: int) -> bytes:
        """The whole body; UpstreamTooLong (and the connection dropped) past `limit` bytes."""
        parts: list[bytes] = []
        size = 0
        async for chunk in self._chunks():
            size += len(chunk)
            if size > limit:
                await self.aclose()
                raise UpstreamTooLong(f"the upstream answered more than {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def lines(self, limit: int) -> AsyncIterator[str]:
        """The body's lines (UTF-8, CR/LF stripped); UpstreamTooLong past `limit` bytes in one line.

        httpx's own `aiter_lines` has no bound: an upstream that never sends a newline would be
        buffered without end.
        """
        pending = bytearray()
        async for chunk in self._chunks():
            pending += chunk
            while (end := pending.find(b"\n")) >= 0:
                if end > limit:
                    await self.aclose()
                    raise UpstreamTooLong(f"the upstream sent a line over {limit} bytes")
                line = bytes(pending[:end])
                del pending[: end + 1]
                yield line.rstrip(b"\r").decode("utf-8", "replace")
            if len(pending) > limit:
                await self.aclose()
                raise UpstreamTooLong(f"the upstream sent a line over {limit} bytes")
        if pending:
            yield bytes(pending).rstrip(b"\r").decode("utf-8", "replace")

    async def aclose(self) -> None:
        """Drop what is left of the answer (a no-op once it was read to its end)."""
        await self._response.aclose()


class UpstreamClient:
    """Pooled keep-alive connections to one upstream (`base_url`), at most `max_connections` open.

    Args:
        base_url: http(s)://host[:port][/prefix]; request paths are appended to it.
        headers: sent with every request (e.g. the upstream's Authorization).
        max_connections: open connections at most (all kept alive between requests); callers
            beyond wait for one, within their per-request timeout.
        connect_timeout_s: for opening a connection.
    """

    def __init__(
        self, base_url: str, headers: Mapping[str, str], max_connections: int, connect_timeout_s: float
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream URL must be http(s)://host[:port], got {base_url!r}")
        self._connect_timeout_s = connect_timeout_s
        #: connections this client has opened so far (a pool that reuses them stays at a few)
        self.connections_opened = 0
        self._client = httpx.AsyncClient(
            base_url=base_url,
            # identity: the fleet's answers are read with a byte bound, never inflated past it
            headers={"accept-encoding": "identity", **headers},
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            # only the connect phase has a client-wide bound; the rest is given per request
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            # the system's trust store, as any other TLS client of the host
            verify=ssl.create_default_context(),
            # no proxy or netrc settings taken from the environment: the config says where to go
            trust_env=False,
            # one client serves every tenant: a cookie set for one caller must never reach another
            cookies=CookieJar(policy=DefaultCookiePolicy(allowed_domains=[])),
            follow_redirects=False,
        )
        self._extensions = {"trace": self._trace}
        self._closed = False

    async def _trace(self, event: str, info: dict[str, Any]) -> None:
        """httpx's documented trace hook: counts new connections (cheap, and the only public view)."""
        if event == "connection.connect_tcp.complete":
            self.connections_opened += 1

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """Send one request; returns once the status line and headers are in.

        `timeout_s` bounds the wait for a pooled connection, each write and each read (so a stream
        whose next bytes take longer fails with TimeoutError); None leaves only the caller's deadline.
        """
        if self._closed:
            raise UpstreamUnreachable("the client is closed")
        timeout = httpx.Timeout(timeout_s, connect=self._connect_timeout_s)
        request = self._client.build_request(
            method, path, content=body, headers=headers, timeout=timeout, extensions=self._extensions
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise _narrowed(exc, self._connect_timeout_s) from None
        return UpstreamResponse(response, self._connect_timeout_s)

    async def aclose(self) -> None:
        self._closed = True
        await self._client.aclose()
