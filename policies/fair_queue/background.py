"""The background class of a deployment's fair queue: batch jobs' requests, below every interactive one.

A background request is dispatched only into capacity that no interactive request is waiting for.
While interactive traffic is present, at most `QueueSpec.background_max_in_flight` of them run at
once (default 1), so interactive requests share the backend with little batch work; after
`background_idle_s` without interactive traffic they may fill all but one slot, which stays free for
the next interactive arrival. Nothing already running is preempted: when interactive traffic comes
back, the background work in flight drains as it finishes.
Tenants take turns (round robin over the tenants with background work waiting). Background service
is not charged to the tenants' fair-share counters: a tenant's batch job never lowers its own
interactive share.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from policies.fair_queue.tenant_queue import Entry, EntryState


class BackgroundLane:
    """Waiting background requests, per tenant in arrival order, and how many are dispatched."""

    def __init__(self) -> None:
        self._queues: OrderedDict[str, deque[Entry]] = OrderedDict()
        self.in_flight = 0

    def __bool__(self) -> bool:
        return bool(self._queues)

    def depth(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def push(self, entry: Entry) -> None:
        self._queues.setdefault(entry.tenant, deque()).append(entry)

    def pop(self) -> Entry:
        """The next tenant's oldest request (that tenant moves to the back of the turn order)."""
        tenant, queue = next(iter(self._queues.items()))
        entry = queue.popleft()
        del self._queues[tenant]
        if queue:
            self._queues[tenant] = queue
        return entry

    def remove(self, entry: Entry) -> None:
        """A waiter was cancelled before its turn."""
        queue = self._queues.get(entry.tenant)
        if queue is not None and entry in queue:
            queue.remove(entry)
            if not queue:
                del self._queues[entry.tenant]
        entry.state = EntryState.CANCELLED
