"""A FIFO-fair count of OpenVINO's free infer requests, kept on the event loop."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

import structlog

log = structlog.get_logger(__name__)

#: how often a request waiting for an idle infer request re-checks the queue anyway, in case a
#: completion was missed (OpenVINO does not call the callback of a request that failed)
_IDLE_POLL_S = 0.05


class Slots:
    """FIFO-fair count of free infer requests, owned by the event loop.

    A slot is taken before `start_async` and given back when the request's result reaches the
    loop; a freed slot goes straight to the longest waiter, so no newcomer overtakes it (which
    would starve waiters and stretch p99).
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.free = size
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self, idle_in_pool: Callable[[], bool]) -> None:
        """Take a slot; `idle_in_pool` lets a waiter recover a slot whose completion was lost."""
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            while not waiter.done():
                try:
                    await asyncio.wait_for(asyncio.shield(waiter), _IDLE_POLL_S)
                except TimeoutError:
                    if waiter.done():
                        break  # `release` handed the slot over as the wait timed out: it is ours
                    # OpenVINO does not call back for a request that failed inside the runtime:
                    # if its pool has an idle request nobody holds a slot for, take that one.
                    if self._waiters[0] is waiter and idle_in_pool():
                        log.warning("openvino_slot_recovered")
                        self._waiters.popleft()
                        return
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over just as the caller gave up
            else:
                waiter.cancel()
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes directly to the longest waiter
                return
        self.free = min(self.size, self.free + 1)
