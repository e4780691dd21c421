"""The `remote` backend's HTTP client: one pooled `aiohttp.ClientSession` per upstream.

aiohttp does the HTTP/1.1 work (keep-alive pool, Content-Length and chunked framing, a pooled
connection the upstream closed while idle dropped before use, an idempotent request sent once more on
a fresh connection when a kept-alive one broke before its answer). It costs a fraction of httpx's CPU
a request on this path (docs/decisions/0004-upstream-http-client.md). This module adds what the
backend needs on top: bodies and stream lines read with a byte bound, and aiohttp's errors narrowed to
two kinds the backend maps to gateway errors.

Errors: `UpstreamUnreachable` (connect failed or took over `connect_timeout_s`, the connection broke,
a malformed answer), `UpstreamTooLong` (a body or a line passed its bound), `TimeoutError` (a
per-request timeout; the caller's own deadlines apply through asyncio timeouts as well).
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

#: seconds an idle pooled connection is kept: under the 5 s of common upstream servers (uvicorn,
#: Node), so the gateway drops an idle connection before the upstream can close it under a request
_IDLE_KEEPALIVE_S = 4.0
#: distinct request paths whose parsed URL is kept (paths are per model: a handful in practice)
_MAX_CACHED_URLS = 256


def _narrowed(exc: aiohttp.ClientError, connect_timeout_s: float) -> Exception:
    """aiohttp's error as the one this module promises (see the module's docstring)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        # an upstream that cannot be reached: another route may serve, as for a refused connection
        return UpstreamUnreachable(f"connecting took over {connect_timeout_s:g} s")
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return TimeoutError(str(exc) or type(exc).__name__)
    return UpstreamUnreachable(f"the connection broke or the answer is malformed: {type(exc).__name__}")


class UpstreamUnreachable(Exception):
    """The upstream could not be reached, or the connection broke before a whole answer came."""


class UpstreamTooLong(Exception):
    """A body or a line passed its byte bound."""


class UpstreamResponse:
    """An answer whose body is still on the wire: read it with `read` or `lines`, or `aclose` it.

    Read to its end, its connection goes back to the pool; closed earlier, the connection is dropped
    (the rest of an answer cannot be skipped on a connection that will be reused).
    """

    __slots__ = ("_response", "_connect_timeout_s")

    def __init__(self, response: aiohttp.ClientResponse, connect_timeout_s: float) -> None:
        self._response = response
        self._connect_timeout_s = connect_timeout_s

    @property
    def status(self) -> int:
        return self._response.status

    @property
    def headers(self) -> Mapping[str, str]:
        """Case-insensitive, as HTTP's header names are."""
        return self._response.headers

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (what the socket has given so far, never re-buffered)."""
        content = self._response.content
        try:
            while data := await content.readany():
                yield data
        except aiohttp.ClientError as exc:
            self._response.close()
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

        aiohttp's own line reader fails at its buffer size, not at the caller's bound.
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
        """Drop what is left of the answer (a no-op once it was read to its end: aiohttp has already
        given the connection back to the pool then)."""
        self._response.close()


class UpstreamClient:
    """Pooled keep-alive connections to one upstream (`base_url`), at most `max_connections` open.

    The session is made at the first request, in the running event loop (aiohttp binds a session to
    the loop it was made in), and closed by `aclose`.

    Args:
        base_url: http(s)://host[:port][/prefix]; request paths are appended to it.
        headers: sent with every request (e.g. the upstream's Authorization).
        max_connections: open connections at most (all kept alive between requests); callers
            beyond wait for one, within their own deadline.
        connect_timeout_s: for opening a connection.
    """

    def __init__(
        self, base_url: str, headers: Mapping[str, str], max_connections: int, connect_timeout_s: float
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream URL must be http(s)://host[:port], got {base_url!r}")
        self._base = base_url.rstrip("/")
        # identity: the fleet's answers are read with a byte bound, never inflated past it
        self._headers = {"accept-encoding": "identity", **headers}
        self._max_connections = max_connections
        self._connect_timeout_s = connect_timeout_s
        #: sockets this client has opened so far, refused ones included (a pool that reuses its
        #: connections stays at a few)
        self.connections_opened = 0
        self._session: aiohttp.ClientSession | None = None
        self._urls: dict[str, URL] = {}
        self._timeouts: dict[float | None, aiohttp.ClientTimeout] = {}
        self._closed = False

    def _socket(self, addr_info: tuple[int, int, int, str, tuple[object, ...]]) -> socket.socket:
        """aiohttp's public socket factory hook: counts new connections at no cost per request."""
        self.connections_opened += 1
        family, kind, proto = addr_info[0], addr_info[1], addr_info[2]
        return socket.socket(family=family, type=kind, proto=proto)

    def _new_session(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(
            limit=self._max_connections,
            limit_per_host=0,
            keepalive_timeout=_IDLE_KEEPALIVE_S,
            # the system's trust store, as any other TLS client of the host
            ssl=ssl.create_default_context(),
            socket_factory=self._socket,
        )
        return aiohttp.ClientSession(
            connector=connector,
            headers=self._headers,
            # only the connect phase has a session-wide bound; reads are bounded per request
            timeout=aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self._connect_timeout_s),
            # one session serves every tenant: a cookie set for one caller must never reach another
            cookie_jar=aiohttp.DummyCookieJar(),
            # bytes read are the bytes on the wire, so the byte bounds hold
            auto_decompress=False,
            # no proxy or netrc settings taken from the environment: the config says where to go
            trust_env=False,
        )

    def _url(self, path: str) -> URL:
        url = self._urls.get(path)
        if url is None:
            url = URL(self._base + path)
            if len(self._urls) < _MAX_CACHED_URLS:
                self._urls[path] = url
        return url

    def _timeout(self, timeout_s: float | None) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get(timeout_s)
        if timeout is None:
            timeout = aiohttp.ClientTimeout(
                total=None, connect=None, sock_connect=self._connect_timeout_s, sock_read=timeout_s
            )
            if len(self._timeouts) < 16:  # deployments have one timeout each: never grows past that
                self._timeouts[timeout_s] = timeout
        return timeout

    async def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """Send one request; returns once the status line and headers are in.

        `timeout_s` bounds each read, the wait for the answer's head included (so a silent upstream,
        or a stream whose next bytes take longer, fails with TimeoutError); None leaves only the
        caller's deadline, which also bounds the wait for a free pooled connection.
        """
        if self._closed:
            raise UpstreamUnreachable("the client is closed")
        session = self._session
        if session is None:
            session = self._session = self._new_session()
        try:
            response = await session.request(
                method,
                self._url(path),
                data=body,
                headers=headers,
                timeout=self._timeout(timeout_s),
                allow_redirects=False,
            )
        except aiohttp.ClientError as exc:
            raise _narrowed(exc, self._connect_timeout_s) from None
        return UpstreamResponse(response, self._connect_timeout_s)

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            await self._session.close()
            self._session = None
