"""The end-to-end deadline of a request (`server.request_timeout_s`).

Everything a request waits for after its headers arrived (the body, the fair queue, the runtime, an
upstream, each event of a stream) runs under one deadline. When it passes, the work is cancelled,
which releases its queue slot and settles its reservation (the core's `finally` blocks), and the
caller gets the protocol's timeout error (504).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fleetgate.errors import GatewayError


def timeout_error(timeout_s: float) -> GatewayError:
    return GatewayError(
        504,
        "request_timeout",
        f"the request did not finish within server.request_timeout_s ({timeout_s:g} s)",
    )


class Deadline:
    """One request's deadline, measured from `started` (a `time.perf_counter()` reading)."""

    __slots__ = ("timeout_s", "_at")

    def __init__(self, timeout_s: float, started: float) -> None:
        self.timeout_s = timeout_s
        loop_now = asyncio.get_running_loop().time()
        self._at = loop_now + timeout_s - (time.perf_counter() - started)

    def scope(self) -> _Scope:
        """`async with deadline.scope():` runs the body under the deadline; its expiry becomes a
        504 GatewayError.

        The body must not yield to a consumer (no `yield` of an async generator inside): a timeout
        scope spanning a yield would cancel whatever the consumer's task does next.
        """
        return _Scope(self)


class _Scope:
    """One use of `Deadline.scope()`, with `asyncio.timeout_at`'s rules: at the deadline the task is
    cancelled, and that cancellation (and no other: the count of the task's cancel requests tells)
    leaves the block as the 504.

    A class of its own rather than `asyncio.timeout_at` inside an `asynccontextmanager`: a request
    enters four to six scopes (and a stream one per event), and that pair cost a tensor request
    about 30 us and a proxied chat request about 60 us of CPU more than this class
    (`bench/bench_hot_path_inprocess.py`, the `deadline` change).
    """

    __slots__ = ("_deadline", "_task", "_timer", "_cancelling", "_expired")

    def __init__(self, deadline: Deadline) -> None:
        self._deadline = deadline

    async def __aenter__(self) -> None:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a deadline scope runs inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._expired = False
        loop = asyncio.get_running_loop()
        # a deadline already past cancels at the body's first await, as asyncio.timeout_at does
        self._timer: asyncio.Handle | None = (
            loop.call_at(self._deadline._at, self._expire)
            if self._deadline._at > loop.time()
            else loop.call_soon(self._expire)
        )

    def _expire(self) -> None:
        self._timer = None
        self._expired = True
        self._task.cancel()

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._expired:
            self._expired = False
            # ours only when no other cancel request arrived meanwhile (a client that went away)
            if self._task.uncancel() <= self._cancelling and kind is asyncio.CancelledError:
                raise timeout_error(self._deadline.timeout_s) from None
