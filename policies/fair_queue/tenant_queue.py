"""One tenant's waiting requests: highest priority first, then arrival order."""

from __future__ import annotations

import asyncio
import enum
import heapq
from collections import deque


class EntryState(enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class Entry:
    """A waiting request. Internal: callers only ever see the `Ticket` it turns into."""

    __slots__ = ("seq", "tenant", "cost", "priority", "deadline", "enqueued_at", "future", "state")

    def __init__(
        self,
        *,
        seq: int,
        tenant: str,
        cost: float,
        priority: int,
        deadline: float | None,
        enqueued_at: float,
        future: asyncio.Future,
    ) -> None:
        self.seq = seq
        self.tenant = tenant
        self.cost = cost
        self.priority = priority
        self.deadline = deadline
        self.enqueued_at = enqueued_at
        self.future = future
        self.state = EntryState.QUEUED


class TenantQueue:
    """Priority heap plus the tenant's places in line; removal is eager (O(n), queues are short).

    A tenant's places in line are the arrival numbers of its queued requests. Dispatch serves the
    highest-priority request but uses up the *oldest* place, so reordering by priority never
    moves a tenant ahead of other tenants (which FCFS and tie-breaks rank by `oldest_seq`).
    """

    __slots__ = ("tenant", "_heap", "_places")

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        # (-priority, seq, entry): seq is unique, so entries themselves are never compared.
        self._heap: list[tuple[int, int, Entry]] = []
        self._places: deque[int] = deque()  # increasing arrival numbers

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, entry: Entry) -> None:
        heapq.heappush(self._heap, (-entry.priority, entry.seq, entry))
        self._places.append(entry.seq)

    def peek(self) -> Entry:
        """The request that would be dispatched next."""
        return self._heap[0][2]

    @property
    def oldest_seq(self) -> int:
        """The tenant's oldest place in line."""
        return self._places[0]

    def pop(self) -> Entry:
        self._places.popleft()
        return heapq.heappop(self._heap)[2]

    def remove(self, entry: Entry) -> None:
        """Take a request out wherever it is (cancellation, deadline)."""
        for i, item in enumerate(self._heap):
            if item[2] is entry:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                break
        if entry.seq in self._places:
            self._places.remove(entry.seq)
        else:
            # Its place was used by a higher-priority request: give up the newest place instead.
            self._places.pop()
