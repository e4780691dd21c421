"""Attempt limiting for the admin API: a client that keeps presenting wrong admin keys is slowed down.

Each client address may fail `max_failures` times within `window_s`; beyond that, its admin requests
are refused with 429 (and Retry-After) until its oldest failure leaves the window, whatever key it
sends, so the admin key cannot be guessed at the speed of the network. A success does not clear the
failures (an attacker who also holds a valid key learns nothing from it). Kept per process.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

from gateway.errors import GatewayError

#: addresses remembered at once (oldest forgotten first): a spray of addresses cannot fill memory
_MAX_ADDRESSES = 10_000


class AdminAttempts:
    def __init__(
        self, max_failures: int = 10, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def check(self, address: str) -> None:
        """Raise 429 when `address` has used up its failed attempts in the window."""
        times = self._recent(address)
        if times is not None and len(times) >= self.max_failures:
            retry = max(1.0, times[0] + self.window_s - self._clock())
            error = GatewayError(
                429, "too_many_admin_failures", "too many failed admin key attempts; try again later"
            )
            error.retry_after_s = retry
            raise error

    def failed(self, address: str) -> None:
        times = self._recent(address)
        if times is None:
            times = self._failures[address] = deque()
            if len(self._failures) > _MAX_ADDRESSES:
                self._failures.popitem(last=False)
        times.append(self._clock())
        self._failures.move_to_end(address)

    def _recent(self, address: str) -> deque[float] | None:
        times = self._failures.get(address)
        if times is None:
            return None
        horizon = self._clock() - self.window_s
        while times and times[0] <= horizon:
            times.popleft()
        return times
