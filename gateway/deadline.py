"""The end-to-end deadline of a request (`server.request_timeout_s`).

Everything a request waits for after its headers arrived (the body, the fair queue, the runtime, an
upstream, each event of a stream) runs under one deadline. When it passes, the work is cancelled,
which releases its queue slot and settles its reservation (the core's `finally` blocks), and the
caller gets the protocol's timeout error (504).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from gateway.errors import GatewayError


def timeout_error(timeout_s: float) -> GatewayError:
    return GatewayError(
        504, "request_timeout", f"the request did not finish within server.request_timeout_s ({timeout_s:g} s)"
    )


class Deadline:
    """One request's deadline, measured from `started` (a `time.perf_counter()` reading)."""

    __slots__ = ("timeout_s", "_at")

    def __init__(self, timeout_s: float, started: float) -> None:
        self.timeout_s = timeout_s
        loop_now = asyncio.get_running_loop().time()
        self._at = loop_now + timeout_s - (time.perf_counter() - started)

    @asynccontextmanager
    async def scope(self) -> AsyncIterator[None]:
        """Run the body under the deadline; its expiry becomes a 504 GatewayError.

        The body must not yield to a consumer (no `yield` of an async generator inside): a timeout
        scope spanning a yield would cancel whatever the consumer's task does next.
        """
        try:
            async with asyncio.timeout_at(self._at):
                yield
        except TimeoutError:
            raise timeout_error(self.timeout_s) from None
