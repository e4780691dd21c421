"""A small HTTP/1.1 keep-alive client for the `remote` backend's upstreams.

A profile of the proxy path under load (c=16, SQLite limits on) put over half of the event loop's
time in the general-purpose client (pool bookkeeping, a readability probe of every pooled socket per
request, layers of stream wrappers). An upstream of the fleet is one host speaking plain HTTP/1.1
with keep-alive, so this client does just that: a pool of persistent connections, requests written
in one call, responses framed by Content-Length or chunked transfer coding, bodies read with a
byte bound. A connection goes back to the pool only when its response was read to the end.

Errors: `UpstreamUnreachable` (connect failed, the connection broke, a malformed answer),
`TimeoutError` (the caller's deadlines apply through asyncio timeouts).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit


class UpstreamUnreachable(Exception):
    """The upstream could not be reached, or the connection broke before a whole answer came."""


class _Stale(Exception):
    """A pooled connection turned out to be closed before the request reached the upstream."""


class UpstreamTooLong(Exception):
    """A body, a line or a header block passed its byte bound."""


_MAX_HEAD_BYTES = 64 * 1024


class _Connection:
    __slots__ = ("reader", "writer", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.reused = False

    def close(self) -> None:
        self.writer.close()


class Response:
    """An answer whose body is still on the wire: read it with `read` or `lines`, or `close` it."""

    def __init__(self, pool: UpstreamPool, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers
        self._pool = pool
        self._conn: _Connection | None = conn
        self._chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        length = headers.get("content-length")
        if length is not None and not length.isdigit():
            conn.close()
            raise UpstreamUnreachable("the upstream sent a malformed Content-Length")
        self._remaining: int | None = int(length) if length is not None and not self._chunked else None
        self._keep = headers.get("connection", "").lower() != "close" and (
            self._chunked or self._remaining is not None
        )
        #: the whole body has been read off the connection
        self._complete = False

    async def _chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; returns the connection to the pool at the end.

        Stopped early (the consumer left, an error, a cancellation), the connection is closed:
        the rest of its answer cannot be skipped on a connection that will be reused.
        """
        conn = self._conn  # None once the body was read or the response closed
        if conn is None:
            return
        if self._chunked:
            body = self._chunked_body(conn.reader)
        elif self._remaining is not None:
            body = self._sized_body(conn.reader)
        else:
            body = self._body_until_close(conn.reader)
        try:
            async for data in body:
                yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ValueError) as exc:
            raise UpstreamUnreachable(f"the upstream's answer broke off: {type(exc).__name__}") from None
        finally:
            if self._conn is conn:
                if self._complete:
                    self._conn = None
                    # bytes past the framed body (a lying upstream) must never reach the next caller
                    clean = not conn.reader._buffer  # noqa: SLF001 - asyncio keeps no public view of it
                    self._pool._release(conn, reusable=self._keep and clean)
                else:
                    self.close()

    async def _chunked_body(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                self._complete = True
                return
            # in pieces: a chunk declared huge is never buffered whole before the caller's bound
            while size > 0:
                data = await reader.readexactly(min(size, 65536))
                size -= len(data)
                yield data
            if await reader.readexactly(2) != b"\r\n":
                raise ValueError("chunk not followed by CRLF")

    async def _sized_body(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        assert self._remaining is not None
        while self._remaining > 0:
            data = await reader.read(min(self._remaining, 65536))
            if not data:
                raise UpstreamUnreachable("the upstream closed the connection mid-body")
            self._remaining -= len(data)
            yield data
        self._complete = True

    async def _body_until_close(self, reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
        while data := await reader.read(65536):
            yield data
        self._complete = True

    async def read(self, limit: int) -> bytes:
        """The whole body; UpstreamTooLong (and the connection closed) past `limit` bytes."""
        parts: list[bytes] = []
        size = 0
        async for chunk in self._chunks():
            size += len(chunk)
            if size > limit:
                self.close()
                raise UpstreamTooLong(f"the upstream answered more than {limit} bytes")
            parts.append(chunk)
        return b"".join(parts)

    async def lines(self, limit: int) -> AsyncIterator[str]:
        """The body's lines (UTF-8, CR/LF stripped); UpstreamTooLong past `limit` bytes in one line."""
        pending = bytearray()
        async for chunk in self._chunks():
            pending += chunk
            while (end := pending.find(b"\n")) >= 0:
                if end > limit:
                    self.close()
                    raise UpstreamTooLong(f"the upstream sent a line over {limit} bytes")
                line = bytes(pending[:end])
                del pending[: end + 1]
                yield line.rstrip(b"\r").decode("utf-8", "replace")
            if len(pending) > limit:
                self.close()
                raise UpstreamTooLong(f"the upstream sent a line over {limit} bytes")
        if pending:
            yield bytes(pending).rstrip(b"\r").decode("utf-8", "replace")

    def close(self) -> None:
        """Drop the connection (a body left unread cannot be skipped on a shared connection)."""
        if self._conn is not None:
            self._conn.close()
            self._pool._release(self._conn, reusable=False)
            self._conn = None


class UpstreamPool:
    """Persistent HTTP/1.1 connections to one upstream (`base_url`), at most `max_connections` open.

    Args:
        base_url: http(s)://host[:port][/prefix].
        headers: sent with every request (e.g. the upstream's Authorization).
        max_connections: open connections at most; callers beyond wait for one.
        connect_timeout_s: for opening a connection.
    """

    def __init__(
        self, base_url: str, headers: Mapping[str, str], max_connections: int, connect_timeout_s: float
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream URL must be http(s)://host[:port], got {base_url!r}")
        self._host = parts.hostname
        self._tls = parts.scheme == "https"
        self._port = parts.port or (443 if self._tls else 80)
        self._prefix = parts.path.rstrip("/")
        authority = parts.netloc.rsplit("@", 1)[-1]
        fixed = {"host": authority, **{k.lower(): v for k, v in headers.items()}}
        self._fixed = "".join(f"{k}: {v}\r\n" for k, v in fixed.items())
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._connect_timeout_s = connect_timeout_s
        self._ssl = ssl.create_default_context() if self._tls else None
        self._closed = False

    async def request(
        self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> Response:
        """Send one request; returns once the status line and headers are in.

        A pooled connection the upstream closed while idle is replaced and the request sent again
        (only when nothing of an answer was read, so the upstream never saw it twice).
        """
        if self._closed:
            raise UpstreamUnreachable("the client is closed")
        await self._slots.acquire()
        try:
            data = self._head(method, path, body, headers) + (body or b"")
            conn = self._idle_connection()
            if conn is not None:
                try:
                    return await self._exchange(conn, data)
                except _Stale:
                    pass  # dropped by the upstream while idle, request unseen: once more, fresh
            return await self._exchange(await self._connect(), data)  # a new one is never _Stale
        except BaseException:
            self._slots.release()
            raise

    async def _exchange(self, conn: _Connection, data: bytes) -> Response:
        """Send `data` on `conn` and read the answer's head; the connection is closed on any failure.

        Raises:
            _Stale: a reused connection was closed by the upstream before a single byte of an answer
                came (it dropped the connection idle and never saw the request): safe to send again.
            UpstreamUnreachable: any other break, after which sending again could run it twice.
        """
        try:
            conn.writer.write(data)
            return await self._read_head(conn)
        except (OSError, asyncio.IncompleteReadError) as exc:
            conn.close()
            if conn.reused and not getattr(exc, "partial", b""):
                raise _Stale from None
            raise UpstreamUnreachable(f"the connection broke: {type(exc).__name__}") from None
        except BaseException:
            conn.close()
            raise

    def _idle_connection(self) -> _Connection | None:
        """A pooled connection that still looks open (the upstream may have closed some meanwhile)."""
        while self._idle:
            conn = self._idle.pop()
            if conn.reader.at_eof() or conn.writer.transport.is_closing():
                conn.close()
                continue
            return conn
        return None

    def _head(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str] | None) -> bytes:
        lines = [f"{method} {self._prefix}{path} HTTP/1.1\r\n", self._fixed]
        if body is not None:
            lines.append(f"content-length: {len(body)}\r\n")
        if headers:
            lines.extend(f"{k}: {v}\r\n" for k, v in headers.items())
        lines.append("\r\n")
        return "".join(lines).encode("latin-1")

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    self._host, self._port, ssl=self._ssl, limit=_MAX_HEAD_BYTES
                )
        except TimeoutError:
            raise UpstreamUnreachable(f"connecting took over {self._connect_timeout_s:g} s") from None
        except OSError as exc:
            raise UpstreamUnreachable(f"cannot connect: {type(exc).__name__}") from None
        return _Connection(reader, writer)

    async def _read_head(self, conn: _Connection) -> Response:
        try:
            raw = await conn.reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            conn.close()
            raise UpstreamUnreachable("the upstream's header block is too large") from None
        status_line, *header_lines = raw[:-4].decode("latin-1").split("\r\n")
        try:
            status = int(status_line.split(" ", 2)[1])
        except (IndexError, ValueError):
            conn.close()
            raise UpstreamUnreachable("the upstream's answer is not HTTP") from None
        headers: dict[str, str] = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return Response(self, conn, status, headers)

    def _release(self, conn: _Connection, *, reusable: bool) -> None:
        if reusable and not self._closed:
            conn.reused = True
            self._idle.append(conn)
        else:
            conn.close()
        self._slots.release()

    @property
    def open_idle(self) -> int:
        """Connections waiting in the pool (tests read it)."""
        return len(self._idle)

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()
