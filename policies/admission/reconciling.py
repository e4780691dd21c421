"""The settling half of `Admission`: `reconcile` (at once with leases), `commit`, deferred settles.

A finished request's reservation is settled once: with the lease strategy into this process's next
batch (`reconcile_at_once`, no store call and no wait), a batch line's with its record by its
runner (`commit`), else by one store settle, kept and retried when the store is down.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import structlog

from policies.admission import settles as st
from policies.admission.reservation import Reservation
from policies.errors import StoreUnavailable
from policies.leases import LeasePath, metrics
from policies.stores.base import Mark, StateStore, UsageDelta
from policies.stores.memory import MemoryStore

log = structlog.get_logger(__name__)


class Reconciling:
    """What `Admission` settles with (its state is set up there)."""

    _store: StateStore
    _local: MemoryStore
    _pending: list[dict]
    _clock: Callable[[], float]
    stats: dict[str, int]
    leases: LeasePath | None

    async def reconcile(
        self,
        reservation: Reservation,
        actual_tokens: int,
        *,
        failed: bool = False,
        parts: Mapping[str, int] | None = None,
        cost_micros: int = 0,
        deployment: str = "",
    ) -> None:
        """Settle a reservation: refund unused tokens and money, record usage and spend, release
        concurrency. Idempotent.

        Args:
            reservation: what `admit` returned.
            actual_tokens: tokens really used (may exceed the reservation; the excess is charged).
            failed: the request was not answered: its request quotas are refunded, usage counts no request.
            parts: usage rows of the request's parts (a graph's steps: `graph/step` -> rows), one
                request each, recorded beside the request's own row; never charged to limits or quotas.
            cost_micros: what the request really cost in micro-USD (its budgets are settled at it).
            deployment: the deployment that served it (its key's usage row names it).

        Never raises for a store outage: the settle is kept and retried on a later call (logged).
        """
        if self.reconcile_at_once(
            reservation, actual_tokens, failed=failed, parts=parts, cost_micros=cost_micros, deployment=deployment
        ):
            return
        reservation.settled = True
        r = reservation
        requests = 0 if failed else 1
        now = self._clock()
        settle = st.reconcile_settle(r, actual_tokens, failed, parts, now, cost_micros, deployment)
        usage = settle["usage"]
        if r.held is not None:  # a batch line: committed by its runner with the line's record
            r.held.hold(settle, st.late_settle(r, actual_tokens, requests, usage, now, cost_micros))
            return
        if r.degraded:
            await self._local.settle(**settle)
            # The shared store never saw this request: charge it there (quotas, usage) when it is back.
            charge = st.whole_charge(r, actual_tokens, requests, cost_micros)
            settle = dict(settle, buckets=[], release=[], counters=charge)
        try:
            applied = await self._store.settle(**settle)
        except StoreUnavailable as exc:
            self.stats["reconcile_deferred"] += 1
            self._pending.append(settle)
            metrics.REQUEST_SETTLES_PENDING.inc()
            log.error("reconcile_deferred", error=exc.detail, reservation=r.id, pending=len(self._pending))
            return
        if not applied and not r.degraded:
            await self._settle_reclaimed(r, actual_tokens, requests, usage, cost_micros)
        if self._pending:
            await self._flush_pending()

    def settles_at_once(self, reservation: Reservation) -> bool:
        """Whether `reconcile_at_once` settles `reservation` (it needs nothing of the store now)."""
        return reservation.settled or (reservation.leased and self.leases is not None)

    def reconcile_at_once(
        self,
        reservation: Reservation,
        actual_tokens: int,
        *,
        failed: bool = False,
        parts: Mapping[str, int] | None = None,
        cost_micros: int = 0,
        deployment: str = "",
    ) -> bool:
        """`reconcile` without waiting, where the settle needs nothing of the store now: a reservation
        already settled, or one the lease strategy settles with its next batch. False where it does
        (call `reconcile`); the arguments are `reconcile`'s."""
        if not self.settles_at_once(reservation):
            return False
        if reservation.settled:
            return True
        assert self.leases is not None
        reservation.settled = True
        now = self._clock()
        settle = st.reconcile_settle(reservation, actual_tokens, failed, parts, now, cost_micros, deployment)
        self.leases.settle(settle)
        return True

    async def _settle_reclaimed(
        self, r: Reservation, actual_tokens: int, requests: int, usage: list[UsageDelta], cost_micros: int
    ) -> None:
        """Record a request whose reservation another process reclaimed (this one seemed dead).

        The reclaim refunded the whole reservation; the request did run, so its usage is recorded
        and its real cost charged to the quotas, once (its own settle id).
        """
        await self._store.settle(**st.late_settle(r, actual_tokens, requests, usage, self._clock(), cost_micros))
        log.warning("reclaimed_reservation_settled_late", reservation=r.id)

    async def commit(self, held: Any, marks: list[Mark]) -> None:
        """Write a background request's `marks` with its held settlement in one atomic store step
        (just the marks when it was never admitted). Raises StoreUnavailable (the caller retries:
        a settlement applied once is never applied again, by its settle id).

        When a reclaim (`recover`, by a process that took this one for dead) refunded the reservation
        first, the request's real cost is charged by its late settle, which carries the marks then.
        """
        settle, late = await held.wait()
        if settle is None:
            await self._store.put_marks(marks)
            return
        if await self._store.settle(**settle, marks=marks) or late is None:
            return
        # Not applied: either this very commit went through before (a retry after an outage that
        # hid its answer: the marks are there) or a reclaim refunded the reservation (they are not).
        # Only the caller writes these marks (it holds the job's claim), so reading them is enough.
        for mark in marks:
            if (await self._store.get_marks(mark.key)).get(mark.field) != mark.value:
                await self._store.settle(**late, marks=marks)
                return

    async def _flush_pending(self) -> None:
        try:
            while self._pending:
                await self._store.settle(**self._pending[0])  # idempotent by settle id
                self._pending.pop(0)
                metrics.REQUEST_SETTLES_PENDING.dec()
        except StoreUnavailable as exc:
            log.error("reconcile_retry_failed", error=exc.detail, pending=len(self._pending))
