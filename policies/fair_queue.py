"""Fair queue in front of one deployment: per-tenant queues, a pluggable order, a capacity gate.

Requests wait in per-tenant queues (highest priority first inside a tenant, then arrival order).
Whenever the backend has capacity, the policy (FCFS, weighted VTC or DRR, see `policies.queueing`)
picks the tenant whose head request is dispatched. The queue is work-conserving: it never leaves
capacity idle while a request waits. Deadlines drop a waiting request with 504 before it reaches
the backend; a cancelled waiter is removed at once; bounded queues answer 429 or 503.

Usage:
    fq = FairQueue(spec, weights={"acme": 2.0})
    ticket = await fq.acquire("acme", cost=rows)
    try:
        ...  # call the backend; for long requests: fq.charge(ticket, delta) as service is delivered
    finally:
        fq.release(ticket, actual_cost=measured)

Not thread-safe: call every method from the event loop that runs `acquire`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

import msgspec

from policies.queueing.base import Head, SchedulingPolicy
from policies.queueing.deadlines import Deadlines
from policies.queueing.drr import DRRPolicy
from policies.queueing.errors import QueueDeadlineExceeded, QueueError, QueueFull
from policies.queueing.fcfs import FCFSPolicy
from policies.queueing.spec import QueueSpec
from policies.queueing.tenant_queue import Entry, EntryState, TenantQueue
from policies.queueing.types import QueueStats, TenantQueueStats, Ticket
from policies.queueing.vtc import VTCPolicy

__all__ = [
    "FairQueue",
    "QueueDeadlineExceeded",
    "QueueError",
    "QueueFull",
    "QueueSpec",
    "QueueStats",
    "TenantQueueStats",
    "Ticket",
    "make_policy",
]

DEFAULT_WEIGHT = 1.0
_MAX_RETRY_AFTER_S = 60.0


def make_policy(spec: QueueSpec, weight_of: Callable[[str], float]) -> SchedulingPolicy:
    """The scheduling policy named by `spec.policy`."""
    if spec.policy == "fcfs":
        return FCFSPolicy()
    if spec.policy == "drr":
        return DRRPolicy(weight_of, spec.drr_quantum)
    return VTCPolicy(weight_of, spec.vtc_burst)


def _check_weights(weights: Mapping[str, float]) -> dict[str, float]:
    for tenant, w in weights.items():
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"weight of tenant {tenant!r} must be a finite number > 0, got {w!r}")
    return dict(weights)


def _head(queue: TenantQueue, stats: TenantQueueStats) -> Head:
    entry = queue.peek()
    return Head(entry.cost, entry.seq, queue.oldest_seq, stats.in_flight)


class FairQueue:
    """Admission queue of one deployment.

    Args:
        spec: queue configuration (policy, concurrency, queue bounds, default deadline).
        weights: fair-share weight per tenant; tenants not listed weigh 1.0.
        clock: monotonic time source in seconds (injected in tests).
        capacity: extra gate consulted before each dispatch (e.g. the LLM engine's free slots and
            KV headroom); a request is dispatched only while fewer than `max_concurrency` are in
            flight AND `capacity()` is True. Call `notify()` when it may have turned True.
    """

    def __init__(
        self,
        spec: QueueSpec,
        *,
        weights: Mapping[str, float],
        clock: Callable[[], float] = time.monotonic,
        capacity: Callable[[], bool] | None = None,
    ) -> None:
        self.spec = spec
        self._clock = clock
        self._capacity = capacity
        self._weights = _check_weights(weights)
        self._policy = make_policy(spec, self.weight)
        self._queues: dict[str, TenantQueue] = {}  # only tenants with queued requests
        self._stats: dict[str, TenantQueueStats] = {}
        self._depth = 0
        self._in_flight = 0
        self._seq = itertools.count()
        self._dispatch_seq = itertools.count()
        self._dispatching = False
        self._recent_dispatches: deque[float] = deque(maxlen=64)
        self._deadlines = Deadlines(clock, self._dispatch)
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- public API ----------------------------------------------------------------------------

    @property
    def policy(self) -> str:
        return self._policy.name

    @property
    def in_flight(self) -> int:
        """Requests dispatched and not yet released."""
        return self._in_flight

    def weight(self, tenant: str) -> float:
        return self._weights.get(tenant, DEFAULT_WEIGHT)

    def update_weights(self, weights: Mapping[str, float]) -> None:
        """Replace the weight table (tenants not listed weigh 1.0); applies to future charges."""
        self._weights = _check_weights(weights)

    def depth(self, tenant: str | None = None) -> int:
        """Requests waiting (not dispatched) for `tenant`, or for the whole deployment."""
        if tenant is None:
            return self._depth
        queue = self._queues.get(tenant)
        return len(queue) if queue is not None else 0

    async def acquire(
        self,
        tenant: str,
        cost: float,
        *,
        priority: int = 0,
        deadline: float | None = None,
        timeout_s: float | None = None,
    ) -> Ticket:
        """Wait for the request's turn and a free unit of capacity.

        Args:
            tenant: who sends the request.
            cost: estimated service in cost units (tokens, rows x per-row cost), charged at dispatch.
            priority: higher goes first among this tenant's own requests.
            deadline: absolute time on this queue's clock after which a waiting request is dropped.
            timeout_s: relative alternative to `deadline` (the earlier of both applies); without
                either, `spec.default_deadline_s` applies.

        Returns:
            The ticket to pass to `charge` and `release`.

        Raises:
            QueueFull: 429 `tenant_queue_full` or 503 `queue_full` (with retry_after_s).
            QueueDeadlineExceeded: 504, the deadline passed while waiting; never dispatched.
            asyncio.CancelledError: the waiter was cancelled; the request left the queue.
        """
        if not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f"cost must be a finite number >= 0, got {cost!r}")
        now = self._clock()
        deadline = self._resolve_deadline(now, deadline, timeout_s)
        stats = self._tenant_stats(tenant)
        if deadline is not None and deadline <= now:
            stats.expired += 1
            raise QueueDeadlineExceeded("request deadline passed before it was queued")
        self._check_room(tenant, stats)
        self._loop = asyncio.get_running_loop()
        entry = Entry(
            seq=next(self._seq),
            tenant=tenant,
            cost=float(cost),
            priority=priority,
            deadline=deadline,
            enqueued_at=now,
            future=self._loop.create_future(),
        )
        self._enqueue(entry, stats)
        self._dispatch()
        try:
            return await entry.future
        except asyncio.CancelledError:
            self._abandon(entry)
            raise

    @asynccontextmanager
    async def slot(
        self,
        tenant: str,
        cost: float,
        *,
        priority: int = 0,
        deadline: float | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[Ticket]:
        """`acquire` then `release` (keeping the charged cost) around a block."""
        ticket = await self.acquire(tenant, cost, priority=priority, deadline=deadline, timeout_s=timeout_s)
        try:
            yield ticket
        finally:
            self.release(ticket)

    def charge(self, ticket: Ticket, delta: float) -> None:
        """Charge service as it is delivered (e.g. 2 x new output tokens) to the ticket's tenant."""
        if ticket.released:
            raise ValueError("ticket already released")
        self._charge(ticket, delta)

    def release(self, ticket: Ticket, actual_cost: float | None = None) -> None:
        """Free the ticket's capacity and dispatch the next request.

        Args:
            ticket: from `acquire`; releasing twice is a no-op.
            actual_cost: the service really delivered; the tenant is charged the difference to
                what was charged so far (a refund when the estimate was high). None keeps it.
        """
        if ticket.released:
            return
        if actual_cost is not None:
            if not math.isfinite(actual_cost) or actual_cost < 0:
                raise ValueError(f"actual_cost must be a finite number >= 0, got {actual_cost!r}")
            self._charge(ticket, actual_cost - ticket.charged)
        ticket.released = True
        self._in_flight -= 1
        stats = self._tenant_stats(ticket.tenant)
        stats.in_flight -= 1
        stats.completed += 1
        self._dispatch()

    def notify(self) -> None:
        """Capacity or time may have changed: drop overdue requests and dispatch what fits."""
        self._dispatch()

    def stats(self) -> QueueStats:
        """A copy of the per-tenant counters, depths and policy state."""
        state = self._policy.state()
        tenants = {}
        for tenant, s in self._stats.items():
            copy = msgspec.structs.replace(s)
            copy.weight = self.weight(tenant)
            copy.depth = self.depth(tenant)
            copy.virtual = state.get(tenant) if self._policy.name != "fcfs" else None
            tenants[tenant] = copy
        return QueueStats(
            policy=self._policy.name,
            max_concurrency=self.spec.max_concurrency,
            in_flight=self._in_flight,
            depth=self._depth,
            tenants=tenants,
        )

    # --- admission -----------------------------------------------------------------------------

    def _tenant_stats(self, tenant: str) -> TenantQueueStats:
        stats = self._stats.get(tenant)
        if stats is None:
            stats = self._stats[tenant] = TenantQueueStats()
        return stats

    def _resolve_deadline(self, now: float, deadline: float | None, timeout_s: float | None) -> float | None:
        if timeout_s is not None:
            deadline = now + timeout_s if deadline is None else min(deadline, now + timeout_s)
        if deadline is None and self.spec.default_deadline_s is not None:
            deadline = now + self.spec.default_deadline_s
        return deadline

    def _check_room(self, tenant: str, stats: TenantQueueStats) -> None:
        if self.depth(tenant) >= self.spec.max_queue_per_tenant:
            stats.rejected_tenant_full += 1
            raise QueueFull.tenant(tenant, self.spec.max_queue_per_tenant, self._retry_after(tenant))
        if self._depth >= self.spec.max_queue_total:
            stats.rejected_queue_full += 1
            raise QueueFull.deployment(self.spec.max_queue_total, self._retry_after(None))

    def _retry_after(self, tenant: str | None) -> float:
        """Rough time for the queue ahead to drain, from the recent dispatch rate."""
        times = self._recent_dispatches
        span = times[-1] - times[0] if len(times) >= 2 else 0.0
        if span <= 0:
            return 1.0
        rate = (len(times) - 1) / span
        if tenant is not None:
            total_w = sum(self.weight(t) for t in self._queues) or 1.0
            rate *= self.weight(tenant) / total_w
            ahead = self.depth(tenant)
        else:
            ahead = self._depth
        return min(_MAX_RETRY_AFTER_S, max(0.1, ahead / rate))

    def _enqueue(self, entry: Entry, stats: TenantQueueStats) -> None:
        queue = self._queues.get(entry.tenant)
        if queue is None:
            others = self._queues.keys()
            self._policy.on_backlogged(entry.tenant, others)
            queue = self._queues[entry.tenant] = TenantQueue(entry.tenant)
        queue.push(entry)
        self._depth += 1
        stats.admitted += 1
        if entry.deadline is not None and self._loop is not None:
            self._deadlines.add(entry, self._loop)

    def _unqueue(self, entry: Entry, state: EntryState) -> None:
        """Take a waiting entry out of its tenant queue (not via dispatch)."""
        queue = self._queues[entry.tenant]
        queue.remove(entry)
        entry.state = state
        self._after_leave(queue)

    def _after_leave(self, queue: TenantQueue) -> None:
        self._depth -= 1
        if not queue:
            del self._queues[queue.tenant]
            self._policy.on_idle(queue.tenant)

    def _abandon(self, entry: Entry) -> None:
        """The waiter was cancelled: leave the queue, or give back a slot granted meanwhile."""
        if entry.state is EntryState.QUEUED:
            self._unqueue(entry, EntryState.CANCELLED)
            self._tenant_stats(entry.tenant).cancelled += 1
        elif entry.state is EntryState.DISPATCHED and not entry.future.cancelled():
            # Granted after the cancel was requested: the request never ran, so refund it.
            self.release(entry.future.result(), actual_cost=0.0)

    # --- dispatch ------------------------------------------------------------------------------

    def _has_capacity(self) -> bool:
        if self._in_flight >= self.spec.max_concurrency:
            return False
        return self._capacity is None or self._capacity()

    def _dispatch(self) -> None:
        if self._dispatching:  # a capacity callback or waiter re-entered us; the outer loop continues
            return
        self._dispatching = True
        try:
            self._expire_overdue()
            while self._queues and self._has_capacity():
                heads = {t: _head(q, self._stats[t]) for t, q in self._queues.items()}
                queue = self._queues[self._policy.select(heads)]
                entry = queue.pop()
                self._after_leave(queue)
                if entry.future.done():  # cancelled; its waiter has not run its handler yet
                    entry.state = EntryState.CANCELLED
                    self._tenant_stats(entry.tenant).cancelled += 1
                    continue
                self._grant(entry)
        finally:
            self._dispatching = False

    def _grant(self, entry: Entry) -> None:
        now = self._clock()
        entry.state = EntryState.DISPATCHED
        ticket = Ticket(
            id=entry.seq,
            tenant=entry.tenant,
            cost=entry.cost,
            priority=entry.priority,
            enqueued_at=entry.enqueued_at,
            dispatched_at=now,
            dispatch_seq=next(self._dispatch_seq),
        )
        self._in_flight += 1
        stats = self._tenant_stats(entry.tenant)
        stats.in_flight += 1
        stats.dispatched += 1
        stats.queue_time_sum_s += ticket.queue_time_s
        stats.queue_time_max_s = max(stats.queue_time_max_s, ticket.queue_time_s)
        self._recent_dispatches.append(now)
        self._charge(ticket, entry.cost)
        entry.future.set_result(ticket)

    def _charge(self, ticket: Ticket, delta: float) -> None:
        if delta:
            self._policy.charge(ticket.tenant, delta)
            ticket.charged += delta
            self._tenant_stats(ticket.tenant).service += delta

    def _expire_overdue(self) -> None:
        now = self._clock()
        for entry in self._deadlines.pop_overdue(now):
            self._unqueue(entry, EntryState.EXPIRED)
            self._tenant_stats(entry.tenant).expired += 1
            if not entry.future.done():
                waited = now - entry.enqueued_at
                entry.future.set_exception(
                    QueueDeadlineExceeded(f"request deadline passed after {waited:.3f} s in the queue")
                )
        self._deadlines.compact(self._depth)
        self._deadlines.rearm(self._loop)
