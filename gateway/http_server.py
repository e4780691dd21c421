"""The HTTP/1.1 protocol the server runs: uvicorn's httptools protocol with a header-read deadline.

uvicorn bounds the idle time between requests on a keep-alive connection, but not the time a client
takes to send a request's headers: a client trickling a header block a byte at a time held its
connection (and, at shutdown, the process) for as long as it liked. Here a connection whose header
block is not complete `header_timeout_s` after it opened (or after the next request began) is closed.
Bodies are bounded by the request deadline (`server.request_timeout_s`) once the headers are in.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

#: read by each process at import (worker processes are spawned and import this module afresh)
HEADER_TIMEOUT_ENV = "FLEETGATE_HEADER_TIMEOUT_S"


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """httptools protocol closing a connection whose headers take over `header_timeout_s`.

    A module-level class (uvicorn hands it to spawned workers by reference), its deadline set by
    `use_header_timeout` in this process and through the environment in workers.
    """

    header_timeout_s: float = float(os.environ.get(HEADER_TIMEOUT_ENV, "10"))
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_message_begin(self) -> None:
        # the next request on a kept-alive connection started: its headers get the same allowance
        # (the idle time between requests is uvicorn's keep-alive timeout, not this deadline)
        super().on_message_begin()
        if self._header_timer is None:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self.cycle is None or self.cycle.response_complete:  # still waiting for headers
            self.transport.close()


def use_header_timeout(seconds: float) -> type[HeaderDeadlineProtocol]:
    """Set the deadline for this process and the workers it starts; returns the protocol class."""
    os.environ[HEADER_TIMEOUT_ENV] = repr(seconds)
    HeaderDeadlineProtocol.header_timeout_s = seconds
    return HeaderDeadlineProtocol
