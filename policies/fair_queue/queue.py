"""Fair queue in front of one deployment: per-tenant queues, a pluggable order, a capacity gate.

Requests wait in per-tenant queues (highest priority first inside a tenant, then arrival order).
Whenever the backend has capacity, the policy (FCFS, weighted VTC or DRR, see `policies.fair_queue`)
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
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

from policies.fair_queue.background import BackgroundLane
from policies.fair_queue.backlog import Backlog
from policies.fair_queue.deadlines import Deadlines, resolve_deadline
from policies.fair_queue.errors import QueueDeadlineExceeded, QueueError, QueueFull
from policies.fair_queue.factory import DEFAULT_WEIGHT, check_weights, make_policy
from policies.fair_queue.spec import QueueSpec
from policies.fair_queue.tenant_queue import Entry, EntryState
from policies.fair_queue.types import QueueStats, TenantQueueStats, Ticket

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
        self._weights = check_weights(weights)
        self._policy = make_policy(spec, self.weight)
        self._backlog = Backlog(spec, self._policy)
        self._background = BackgroundLane()
        #: clock time interactive traffic was last seen (an arrival or a release)
        self._interactive_seen = -math.inf
        self._in_flight = 0
        self._seq = itertools.count()
        self._dispatch_seq = itertools.count()
        self._dispatching = False
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
        self._weights = check_weights(weights)

    def depth(self, tenant: str | None = None) -> int:
        """Requests waiting (not dispatched) for `tenant`, or for the whole deployment."""
        return self._backlog.depth(tenant)

    def check_room(self, tenant: str) -> None:
        """Raise QueueFull now when `acquire` for `tenant` would: a refusal that costs microseconds.

        The gateway calls it before reading and decoding a request's body, so a tenant whose own
        queue is full is turned away without the work its request would cost.
        """
        waiting_weight = sum(self.weight(t) for t in self._backlog.tenants()) or 1.0
        self._backlog.check_room(tenant, share=self.weight(tenant) / waiting_weight)

    async def acquire(
        self,
        tenant: str,
        cost: float,
        *,
        priority: int = 0,
        deadline: float | None = None,
        timeout_s: float | None = None,
        continuing: bool = False,
        background: bool = False,
    ) -> Ticket:
        """Wait for the request's turn and a free unit of capacity.

        Args:
            tenant: who sends the request.
            cost: estimated service in cost units (tokens, rows x per-row cost), charged at dispatch.
            priority: higher goes first among this tenant's own requests.
            deadline: absolute time on this queue's clock after which a waiting request is dropped.
            timeout_s: relative alternative to `deadline` (the earlier of both applies); without
                either, `spec.default_deadline_s` applies.
            continuing: a later part of a request already admitted here (`split_rows` slices): not
                refused for a full queue, so a started request is never cut half-way.
            background: wait in the background class (batch jobs): dispatched only into capacity
                no interactive request waits for; no deadline, no queue bound (its caller paces it).

        Returns:
            The ticket to pass to `charge` and `release`.

        Raises:
            QueueFull: 429 `tenant_queue_full` or 503 `queue_full` (with retry_after_s).
            QueueDeadlineExceeded: 504, the deadline passed while waiting; never dispatched.
            asyncio.CancelledError: the waiter was cancelled; the request left the queue.
        """
        if not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f"cost must be a finite number >= 0, got {cost!r}")
        if background:
            return await self._acquire_background(tenant, cost, priority)
        now = self._interactive_seen = self._clock()
        deadline = resolve_deadline(now, deadline, timeout_s, self.spec.default_deadline_s)
        if deadline is not None and deadline <= now:
            self._backlog.stats_of(tenant).expired += 1
            raise QueueDeadlineExceeded("request deadline passed before it was queued")
        if not continuing:
            self.check_room(tenant)
        if self._can_pass_through():
            return self._pass_through(tenant, float(cost), priority, now)
        entry = self._entry(tenant, cost, priority, deadline, now)
        self._backlog.push(entry)
        if entry.deadline is not None:
            self._deadlines.add(entry, self._loop)
        self._dispatch()
        try:
            return await entry.future
        except asyncio.CancelledError:
            self._abandon(entry)
            raise

    def _can_pass_through(self) -> bool:
        """Nobody waits and a slot is free: a request is dispatched the moment it arrives."""
        return not self._backlog and not self._dispatching and self._has_capacity()

    def _pass_through(self, tenant: str, cost: float, priority: int, now: float) -> Ticket:
        """What queueing, dispatching and granting a request do when nobody waits and a slot is free,
        without the waiting machinery (an entry and its future, a deadline timer, the policy's
        choice among one head): the policy still sees the tenant arrive and leave, and the counters
        and the charge are the same. Most requests of a deployment that is not saturated take this."""
        self._backlog.pass_through(tenant)
        return self._dispatch_ticket(next(self._seq), tenant, cost, priority, now, now)

    def _entry(self, tenant: str, cost: float, priority: int, deadline: float | None, now: float) -> Entry:
        """A waiter's entry, with the future its dispatch resolves (on the running loop)."""
        self._loop = asyncio.get_running_loop()
        return Entry(
            seq=next(self._seq),
            tenant=tenant,
            cost=float(cost),
            priority=priority,
            deadline=deadline,
            enqueued_at=now,
            future=self._loop.create_future(),
        )

    async def _acquire_background(self, tenant: str, cost: float, priority: int) -> Ticket:
        entry = self._entry(tenant, cost, priority, None, self._clock())
        self._background.push(entry)
        self._dispatch()
        try:
            return await entry.future
        except asyncio.CancelledError:
            if entry.state is EntryState.QUEUED:
                self._background.remove(entry)
            elif entry.state is EntryState.DISPATCHED and not entry.future.cancelled():
                self.release(entry.future.result(), actual_cost=0.0)
            raise

    @asynccontextmanager
    async def slot(self, tenant: str, cost: float, **kwargs: float | int | None) -> AsyncIterator[Ticket]:
        """`acquire` (same keyword arguments) then `release`, keeping the charged cost, around a block."""
        ticket = await self.acquire(tenant, cost, **kwargs)  # type: ignore[arg-type]
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
        if ticket.background:
            self._background.in_flight -= 1
        else:
            self._backlog.released(ticket)
            self._interactive_seen = self._clock()
        self._dispatch()

    def notify(self) -> None:
        """Capacity or time may have changed: drop overdue requests and dispatch what fits."""
        self._dispatch()

    def stats(self) -> QueueStats:
        """A copy of the per-tenant counters, depths and policy state."""
        state = self._policy.state()
        tenants = self._backlog.all_stats()
        for tenant, copy in tenants.items():
            copy.weight = self.weight(tenant)
            copy.virtual = state.get(tenant) if self._policy.name != "fcfs" else None
        return QueueStats(
            policy=self._policy.name,
            max_concurrency=self.spec.max_concurrency,
            in_flight=self._in_flight,
            depth=self.depth(),
            tenants=tenants,
            background_in_flight=self._background.in_flight,
            background_depth=self._background.depth(),
        )

    # --- waiting -------------------------------------------------------------------------------

    def _abandon(self, entry: Entry) -> None:
        """The waiter was cancelled: leave the queue, or give back a slot granted meanwhile."""
        if entry.state is EntryState.QUEUED:
            self._backlog.remove(entry, EntryState.CANCELLED)
            self._backlog.stats_of(entry.tenant).cancelled += 1
        elif entry.state is EntryState.DISPATCHED and not entry.future.cancelled():
            # Granted after the cancel was requested: the request never ran, so refund it.
            self.release(entry.future.result(), actual_cost=0.0)

    def _expire_overdue(self) -> None:
        now = self._clock()
        for entry in self._deadlines.pop_overdue(now):
            self._backlog.expire(entry, now)
        self._deadlines.compact(self.depth())
        self._deadlines.rearm(self._loop)

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
            while self._backlog and self._has_capacity():
                entry = self._backlog.pop_next()
                if entry.future.done():  # cancelled; its waiter has not run its handler yet
                    entry.state = EntryState.CANCELLED
                    self._backlog.stats_of(entry.tenant).cancelled += 1
                    continue
                self._grant(entry)
            # the background class fills what is left: nobody interactive waits, a slot is free
            while (
                self._background
                and not self._backlog
                and self._background.in_flight < self._background_limit()
                and self._has_capacity()
            ):
                entry = self._background.pop()
                if entry.future.done():
                    entry.state = EntryState.CANCELLED
                    continue
                self._grant(entry, background=True)
        finally:
            self._dispatching = False

    def _background_limit(self) -> int:
        interactive = self._in_flight - self._background.in_flight
        recent = self._clock() - self._interactive_seen < self.spec.background_idle_s
        return self.spec.background_limit(interactive > 0 or recent)

    def _grant(self, entry: Entry, background: bool = False) -> None:
        entry.state = EntryState.DISPATCHED
        ticket = self._dispatch_ticket(
            entry.seq, entry.tenant, entry.cost, entry.priority, entry.enqueued_at, self._clock(), background
        )
        entry.future.set_result(ticket)

    def _dispatch_ticket(
        self,
        seq: int,
        tenant: str,
        cost: float,
        priority: int,
        enqueued_at: float,
        now: float,
        background: bool = False,
    ) -> Ticket:
        """A request leaves for the backend: its ticket, a slot taken, counted and charged."""
        ticket = Ticket(
            id=seq,
            tenant=tenant,
            cost=cost,
            priority=priority,
            enqueued_at=enqueued_at,
            dispatched_at=now,
            dispatch_seq=next(self._dispatch_seq),
            background=background,
        )
        self._in_flight += 1
        if background:
            self._background.in_flight += 1
        else:
            self._backlog.granted(ticket)
        self._charge(ticket, cost)
        return ticket

    def _charge(self, ticket: Ticket, delta: float) -> None:
        if ticket.background:  # not against the tenant's fair share (see background.py)
            ticket.charged += delta
            return
        if delta:
            self._policy.charge(ticket.tenant, delta)
            ticket.charged += delta
            self._backlog.stats_of(ticket.tenant).service += delta
