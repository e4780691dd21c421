"""Deadlines of waiting requests: an earliest-first heap and one event-loop timer for the earliest.

Entries that leave the queue another way (dispatch, cancellation) stay in the heap and are skipped
when they surface; the heap is rebuilt when such stale entries outnumber the live ones.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable

from policies.fair_queue.tenant_queue import Entry, EntryState

_MIN_TIMER_S = 0.001  # never re-arm tighter than this: an injected clock may not move at all


def resolve_deadline(
    now: float, deadline: float | None, timeout_s: float | None, default_s: float | None
) -> float | None:
    """The absolute deadline of a request: the earlier of `deadline` and `now + timeout_s`, or
    `now + default_s` when neither is given (None: no deadline)."""
    if timeout_s is not None:
        deadline = now + timeout_s if deadline is None else min(deadline, now + timeout_s)
    if deadline is None and default_s is not None:
        deadline = now + default_s
    return deadline


class Deadlines:
    """Tracks queued entries by deadline and calls `on_due` when the earliest may have passed.

    `on_due` only says "look now"; the queue decides with its own clock which entries expired, so
    a test clock that does not follow real time stays in charge (`pop_overdue`).
    """

    def __init__(self, clock: Callable[[], float], on_due: Callable[[], None]) -> None:
        self._clock = clock
        self._on_due = on_due
        self._heap: list[tuple[float, int, Entry]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    def add(self, entry: Entry, loop: asyncio.AbstractEventLoop) -> None:
        assert entry.deadline is not None
        heapq.heappush(self._heap, (entry.deadline, entry.seq, entry))
        if entry.deadline < self._timer_at:
            self.rearm(loop)

    def pop_overdue(self, now: float) -> list[Entry]:
        """Queued entries whose deadline is at or before `now`, earliest first."""
        heap, due = self._heap, []
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)[2]
            if entry.state is EntryState.QUEUED:
                due.append(entry)
        return due

    def compact(self, live: int) -> None:
        """Drop stale entries once they clearly outnumber the `live` queued requests."""
        if len(self._heap) > 2 * live + 64:
            self._heap = [item for item in self._heap if item[2].state is EntryState.QUEUED]
            heapq.heapify(self._heap)

    def rearm(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Point the timer at the earliest live deadline (or cancel it when there is none)."""
        heap = self._heap
        while heap and heap[0][2].state is not EntryState.QUEUED:
            heapq.heappop(heap)
        next_at = heap[0][0] if heap else math.inf
        if next_at == self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = next_at
        if heap and loop is not None:
            delay = max(_MIN_TIMER_S, next_at - self._clock())
            self._timer = loop.call_later(delay, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        self._on_due()
