"""The HTTP/1.1 protocol the server runs: uvicorn's httptools protocol with connection limits.

uvicorn bounds the idle time between requests on a keep-alive connection and the number of open
connections (`server.max_connections`), but not what one client may hold, nor the time a client
takes to start and finish a request's headers: 2,100 sockets that never sent a byte filled every
connection slot, and every request, `/health/live` included, got 503. Here, per process:

- a connection that has sent no byte `first_byte_timeout_s` after it opened is closed;
- a connection whose header block is not complete `header_timeout_s` after it opened (or after the
  next request on it began) is closed; bodies are bounded by the request deadline once headers are in;
- one client address may hold `max_connections_per_client` connections (IPv6: one /64 counts as one
  address); beyond, a new connection is answered 503 and closed. Trusted proxies are not capped.

At shutdown (gateway/serve/drain.py) a connection is never closed under a request that may be on its way:
one that has not sent its first request yet is answered when it does (503 + `Connection: close` while
the gateway refuses new work); an idle kept-alive one gets `LAST_CALL_S` to send one more request,
answered with `Connection: close`, before it is closed.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import structlog
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = structlog.get_logger(__name__)

#: at shutdown, how long an idle kept-alive connection may still send one request (answered with
#: `Connection: close`) before it is closed: a client that keeps sending is answered, not reset
LAST_CALL_S = 1.0
#: a refusal for the per-client cap is logged at most this often (a flood would flood the log)
_REFUSAL_LOG_EVERY_S = 10.0
_OVER_CAP_BODY = b'{"error": "too many open connections from this address; retry later"}'
_OVER_CAP = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_OVER_CAP_BODY), _OVER_CAP_BODY)
)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits every connection of this process gets (`server.*` of the config)."""

    header_timeout_s: float = 10.0
    first_byte_timeout_s: float = 5.0
    max_per_client: int = 256
    #: peers not capped per address (`server.trusted_proxies`): each carries many clients
    uncapped: tuple[Network, ...] = ()


def limits_of(server: Any) -> ConnectionLimits:
    """The limits of a `ServerConfig` (`trusted_proxies` entries are validated by the config)."""
    uncapped = tuple(
        ipaddress.ip_network("0.0.0.0/0" if p == "*" else p) for p in server.trusted_proxies
    ) + ((ipaddress.ip_network("::/0"),) if "*" in server.trusted_proxies else ())
    return ConnectionLimits(
        header_timeout_s=server.header_timeout_s,
        first_byte_timeout_s=server.first_byte_timeout_s,
        max_per_client=server.max_connections_per_client,
        uncapped=uncapped,
    )


def client_key(host: str, uncapped: tuple[Network, ...]) -> str | None:
    """The address a connection counts against, or None when it is not capped (a trusted proxy,
    a Unix socket). An IPv6 client usually holds a whole /64, so the /64 is the address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    if any(address in net for net in uncapped):
        return None
    if address.version == 6:
        return str(ipaddress.ip_network((address, 64), strict=False))
    return host


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """httptools protocol with the limits above.

    A module-level class (uvicorn hands it to spawned workers by reference); `configure` sets the
    limits in each process that serves (gateway/serve/commands/serve.py, and each worker's app factory).
    """

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    #: open connections per client address in this process
    _open: ClassVar[dict[str, int]] = {}
    _refusals_logged_at: ClassVar[float] = 0.0

    _header_timer: asyncio.TimerHandle | None = None
    _first_byte_timer: asyncio.TimerHandle | None = None
    _last_call_timer: asyncio.TimerHandle | None = None
    _client_key: str | None = None
    _received: bool = False
    #: a request's header block is being read (its deadline bounds it, also at shutdown)
    _in_headers: bool = False
    _closing: bool = False

    @classmethod
    def configure(cls, limits: ConnectionLimits) -> type[HeaderDeadlineProtocol]:
        """Set this process's limits; returns the class (what uvicorn's `http` option takes)."""
        cls.limits = limits
        return cls

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.client is not None:
            self._client_key = client_key(self.client[0], self.limits.uncapped)
        if self._client_key is not None:
            count = self._open.get(self._client_key, 0) + 1
            self._open[self._client_key] = count
            if count > self.limits.max_per_client:
                self._refuse_over_cap()
                return
        self._first_byte_timer = self.loop.call_later(self.limits.first_byte_timeout_s, self._silent)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if not self._received:
            self._received = True
            _cancel(self._first_byte_timer)
            self._first_byte_timer = None
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._in_headers = False
        self._disarm()
        super().on_headers_complete()
        if self._closing and self.cycle is not None:
            self.cycle.keep_alive = False  # shutting down: this answer closes the connection

    def on_message_begin(self) -> None:
        # the next request on a kept-alive connection started: its headers get the same allowance
        # (the idle time between requests is uvicorn's keep-alive timeout, not this deadline)
        super().on_message_begin()
        self._in_headers = True
        _cancel(self._last_call_timer)
        self._last_call_timer = None
        if self._header_timer is None:
            self._arm()

    def shutdown(self) -> None:
        """The server's shutdown: close this connection without cutting a request on its way."""
        self._closing = True
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # answered, then closed
        elif self._received and not self._in_headers and self._last_call_timer is None:
            self._last_call_timer = self.loop.call_later(LAST_CALL_S, self._close_if_idle)
        # else: a request is on its way (no byte yet from a client that just connected, or its
        # headers coming in): it is answered when it is in, and the first-byte and header deadlines
        # still close the connection if it never is

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._header_timer, self._first_byte_timer, self._last_call_timer):
            _cancel(timer)
        self._header_timer = self._first_byte_timer = self._last_call_timer = None
        if self._client_key is not None:
            left = self._open.get(self._client_key, 1) - 1
            if left > 0:
                self._open[self._client_key] = left
            else:
                self._open.pop(self._client_key, None)
            self._client_key = None
        super().connection_lost(exc)

    def _refuse_over_cap(self) -> None:
        now = time.monotonic()
        if now - HeaderDeadlineProtocol._refusals_logged_at >= _REFUSAL_LOG_EVERY_S:
            HeaderDeadlineProtocol._refusals_logged_at = now
            log.warning(
                "connections_per_client_exceeded", client=self._client_key, limit=self.limits.max_per_client
            )
        self.transport.write(_OVER_CAP)
        self.transport.close()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        _cancel(self._header_timer)
        self._header_timer = None

    def _silent(self) -> None:
        self._first_byte_timer = None
        if not self._received:
            self.transport.close()

    def _expired(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:  # still waiting for headers
            self.transport.close()

    def _close_if_idle(self) -> None:
        self._last_call_timer = None
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()
