"""The waiting requests of one deployment: per-tenant queues, per-tenant counters, bounds.

The backlog tells the ordering policy when a tenant becomes backlogged or idle, so the policy's
view of "who is waiting" always matches the queues. It knows nothing of capacity or time.
"""

from __future__ import annotations

from collections import deque

import msgspec

from policies.fair_queue.base import Head, SchedulingPolicy
from policies.fair_queue.errors import QueueDeadlineExceeded, QueueFull
from policies.fair_queue.spec import QueueSpec
from policies.fair_queue.tenant_queue import Entry, EntryState, TenantQueue
from policies.fair_queue.types import TenantQueueStats, Ticket

_MAX_RETRY_AFTER_S = 60.0


class Backlog:
    """Per-tenant FIFO queues (priority first) of one deployment, with their counters."""

    def __init__(self, spec: QueueSpec, policy: SchedulingPolicy) -> None:
        self._spec = spec
        self._policy = policy
        self._queues: dict[str, TenantQueue] = {}  # only tenants with queued requests
        self._stats: dict[str, TenantQueueStats] = {}
        self._depth = 0
        self._recent_dispatches: deque[float] = deque(maxlen=64)

    def __bool__(self) -> bool:
        return bool(self._queues)

    def tenants(self) -> list[str]:
        """Tenants with requests waiting."""
        return list(self._queues)

    def depth(self, tenant: str | None = None) -> int:
        """Requests waiting for `tenant`, or for the whole deployment."""
        if tenant is None:
            return self._depth
        queue = self._queues.get(tenant)
        return len(queue) if queue is not None else 0

    def stats_of(self, tenant: str) -> TenantQueueStats:
        """The tenant's live counters (created on first use)."""
        stats = self._stats.get(tenant)
        if stats is None:
            stats = self._stats[tenant] = TenantQueueStats()
        return stats

    def all_stats(self) -> dict[str, TenantQueueStats]:
        """Copies of every tenant's counters, with the current depth filled in."""
        out = {}
        for tenant, stats in self._stats.items():
            copy = msgspec.structs.replace(stats)
            copy.depth = self.depth(tenant)
            out[tenant] = copy
        return out

    # --- admission -----------------------------------------------------------------------------

    def check_room(self, tenant: str, share: float) -> None:
        """Raise QueueFull (429 for the tenant's own queue, 503 for the deployment's) when full.

        Args:
            tenant: who wants to queue a request.
            share: the tenant's fraction of the dispatch rate, for its Retry-After.
        """
        stats = self.stats_of(tenant)
        if self.depth(tenant) >= self._spec.max_queue_per_tenant:
            stats.rejected_tenant_full += 1
            retry = self._retry_after(self.depth(tenant), share)
            raise QueueFull.tenant(tenant, self._spec.max_queue_per_tenant, retry)
        if self._depth >= self._spec.max_queue_total:
            stats.rejected_queue_full += 1
            raise QueueFull.deployment(self._spec.max_queue_total, self._retry_after(self._depth, 1.0))

    def _retry_after(self, ahead: int, share: float) -> float:
        """Rough time for `ahead` requests to drain at `share` of the recent dispatch rate."""
        times = self._recent_dispatches
        span = times[-1] - times[0] if len(times) >= 2 else 0.0
        if span <= 0:
            return 1.0
        rate = (len(times) - 1) / span * share
        return min(_MAX_RETRY_AFTER_S, max(0.1, ahead / rate))

    def push(self, entry: Entry) -> None:
        queue = self._queues.get(entry.tenant)
        if queue is None:
            self._policy.on_backlogged(entry.tenant, self._queues.keys())
            queue = self._queues[entry.tenant] = TenantQueue(entry.tenant)
        queue.push(entry)
        self._depth += 1
        self.stats_of(entry.tenant).admitted += 1

    def pass_through(self, tenant: str) -> None:
        """A request that found nobody waiting and a free slot joins and leaves its tenant's queue at
        once: the policy sees the arrival (VTC's lift) and the departure, as `push` then `pop_next`
        would show them."""
        assert not self._queues, "only when nobody waits"
        self._policy.on_backlogged(tenant, ())
        self.stats_of(tenant).admitted += 1
        self._policy.on_idle(tenant)

    def remove(self, entry: Entry, state: EntryState) -> None:
        """Take a waiting entry out of its queue (cancellation, deadline)."""
        queue = self._queues[entry.tenant]
        queue.remove(entry)
        entry.state = state
        self._after_leave(queue)

    def expire(self, entry: Entry, now: float) -> None:
        """The entry's deadline passed while it waited: out of the queue, its waiter gets 504."""
        self.remove(entry, EntryState.EXPIRED)
        self.stats_of(entry.tenant).expired += 1
        if not entry.future.done():
            waited = now - entry.enqueued_at
            entry.future.set_exception(
                QueueDeadlineExceeded(f"request deadline passed after {waited:.3f} s in the queue")
            )

    # --- dispatch ------------------------------------------------------------------------------

    def pop_next(self) -> Entry:
        """The head request of the tenant the policy picks, out of its queue (must be non-empty)."""
        heads = {t: self._head(q) for t, q in self._queues.items()}
        queue = self._queues[self._policy.select(heads)]
        entry = queue.pop()
        self._after_leave(queue)
        return entry

    def granted(self, ticket: Ticket) -> None:
        """A request left for the backend: count it (and feed the Retry-After estimate)."""
        stats = self.stats_of(ticket.tenant)
        stats.in_flight += 1
        stats.dispatched += 1
        stats.queue_time_sum_s += ticket.queue_time_s
        stats.queue_time_max_s = max(stats.queue_time_max_s, ticket.queue_time_s)
        self._recent_dispatches.append(ticket.dispatched_at)

    def released(self, ticket: Ticket) -> None:
        """A dispatched request is done."""
        stats = self.stats_of(ticket.tenant)
        stats.in_flight -= 1
        stats.completed += 1

    def _head(self, queue: TenantQueue) -> Head:
        entry = queue.peek()
        return Head(entry.cost, entry.seq, queue.oldest_seq, self.stats_of(queue.tenant).in_flight)

    def _after_leave(self, queue: TenantQueue) -> None:
        self._depth -= 1
        if not queue:
            del self._queues[queue.tenant]
            self._policy.on_idle(queue.tenant)
