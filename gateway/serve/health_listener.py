"""The probes' own port (`server.health_port`): liveness and readiness outside every connection cap.

The main port's connection caps (`server.max_connections`, `max_connections_per_client`) protect the
gateway from a flood of sockets, but a flood that reaches them also refuses the probes, and a
Kubernetes liveness probe failing there restarts pods that were healthy. This listener answers only
`GET /health/live`, `/health/ready`, `/v2/health/live` and `/v2/health/ready`, with the same answers
as the main port (readiness follows `server.readiness` and the drain), one request per connection.
It runs in the app's lifespan: live while models load, ready once they can serve, and still
answering (not ready) through a drain, until the process ends. With `server.workers > 1` every
worker binds it (SO_REUSEPORT), so a probe reaches some worker, as on the main port.

Requests are parsed by h11 (uvicorn's own HTTP/1.1 library); a connection must deliver its request
within `header_timeout_s`, and a header block is bounded, so this port cannot be held either.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable

import h11

from gateway.config import ServerConfig

#: the most bytes of a probe's request line and headers
_MAX_HEADER_BYTES = 8192


def _answer(path: str, ready: Callable[[], bool]) -> tuple[int, dict[str, object]]:
    """The status and body the main port's route of the same path answers (gateway/http/probes.py,
    gateway/http/kserve.py); 404 for any other path."""
    if path == "/health/live":
        return 200, {"status": "live"}
    if path == "/v2/health/live":
        return 200, {"live": True}
    if path in ("/health/ready", "/v2/health/ready"):
        ok = ready()
        body: dict[str, object] = (
            {"status": "ready" if ok else "not_ready"} if path == "/health/ready" else {"ready": ok}
        )
        return (200 if ok else 503), body
    return 404, {"error": "this port serves only /health/live, /health/ready and /v2/health/{live,ready}"}


class HealthListener:
    """A running health listener; `close()` stops it."""

    def __init__(self, server: asyncio.Server) -> None:
        self._server = server

    @property
    def address(self) -> tuple[str, int]:
        """The bound (host, port)."""
        return self._server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        self._server.close()
        await self._server.wait_closed()


async def start_health_listener(
    host: str, port: int, ready: Callable[[], bool], deadline_s: float, shared: bool = False
) -> HealthListener:
    """Listen on `host:port`; `ready()` is asked at each readiness probe.

    Args:
        host: the address to bind (`server.host`).
        port: the port (`server.health_port`; 0 picks a free one).
        ready: whether the gateway can serve now.
        deadline_s: the time a connection has to deliver its whole request.
        shared: bind with SO_REUSEPORT (the workers of `server.workers > 1` share the port).
    """

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(deadline_s):
                request = await _read_request(reader)
            if request is None:
                return
            method, path = request
            status, body = _answer(path, ready) if method in ("GET", "HEAD") else (405, {"error": "use GET"})
            payload = json.dumps(body).encode()
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(payload)}\r\ncache-control: no-store\r\nconnection: close\r\n\r\n"
            ).encode("latin-1")
            writer.write(head + (b"" if method == "HEAD" else payload))
            await writer.drain()
        except (TimeoutError, ConnectionError, h11.RemoteProtocolError):
            pass  # a probe that did not finish its request, or went away: nothing to answer
        finally:
            writer.close()

    server = await asyncio.start_server(
        handle, host=host, port=port, reuse_port=shared, family=socket.AF_UNSPEC, limit=_MAX_HEADER_BYTES
    )
    return HealthListener(server)


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str] | None:
    """(method, path) of the connection's first request, None when it closed before one."""
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEADER_BYTES)
    while True:
        event = connection.next_event()
        if isinstance(event, h11.Request):
            path = event.target.decode("latin-1").split("?", 1)[0]
            return event.method.decode("latin-1"), path
        if event is h11.NEED_DATA:
            data = await reader.read(4096)
            connection.receive_data(data)  # b"" is the end of the stream
            continue
        return None  # h11.ConnectionClosed


_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


async def start_configured(server: ServerConfig, ready: Callable[[], bool]) -> HealthListener | None:
    """The listener `server.health_port` asks for (None when off), in the app's lifespan.

    Raises:
        OSError: the port cannot be bound; the message names the setting.
    """
    if server.health_port is None:
        return None
    try:
        return await start_health_listener(
            server.host, server.health_port, ready, server.header_timeout_s, shared=server.workers > 1
        )
    except OSError as exc:
        where = f"{server.host}:{server.health_port}"
        raise OSError(exc.errno, f"cannot listen on {where} (server.health_port): {exc.strerror}") from None
