"""`LeasePath`: admission from slices held in memory, settlement in batches, partition tolerance.

The common request touches no store: its units come from slices this process took ahead (one store
acquire per slice, `slices.py`), its concurrency from slots it holds (`slots.py`), and its settlement
goes to a ledger written every `flush_s` (`ledger.py`). A request the slices cannot cover takes a
top-up: one acquire of every op of the request, each costing what this process lacks (what it needs
less what it holds, grown to a slice's size when the store has room): the same yes or no, Retry-After
included, that a per-request acquire would answer, because the store counts the units held here as
used. Every tick takes fresh slices for the keys in use (while requests admit from the old ones) and
gives every older slice's unused units back, so the store's journal of a slice never holds units
admitted before the last tick: the crash recovery of a dead process gives back what it had not
admitted by then (docs/state.md).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Iterable, Sequence
from secrets import token_hex
from typing import Any

import structlog

from policies import ratelimit as rl
from policies.errors import StoreUnavailable
from policies.leases.ledger import Ledger
from policies.leases.metrics import LOCAL_ADMITS, TOPUPS
from policies.leases.partition import PartitionTolerance
from policies.leases.settings import LeaseSettings, PartitionSettings
from policies.leases.slices import Grant, SliceBook
from policies.leases.slots import SlotPool
from policies.leases.ticks import Ticking, settle_args
from policies.stores.base import (
    AcquireResult,
    BucketOp,
    BucketView,
    CounterOp,
    Denial,
    Journal,
    LeaseOp,
    StateStore,
)

log = structlog.get_logger(__name__)

#: the capacity given to a bucket op that takes nothing in a top-up (its check must never refuse)
_UNCHECKED = 1e18


def _release(pools: Iterable[SlotPool]) -> None:
    for p in pools:
        p.release()


class LeasePath(Ticking, PartitionTolerance):
    """One process's slices, slots and ledger on a shared store."""

    def __init__(
        self,
        store: StateStore,
        instance: str,
        clock: Callable[[], float],
        settings: LeaseSettings,
        partition: PartitionSettings | None,
        lease_ttl_s: float,
    ) -> None:
        self._store = store
        self._instance = instance
        self._clock = clock
        self.settings = settings
        self.partition = partition
        self._lease_ttl_s = lease_ttl_s
        self.book = SliceBook(settings.slice_s, settings.max_share)
        self.slots: dict[str, SlotPool] = {}
        self.ledger = Ledger(instance)
        #: store settles not yet applied (grants given back, batches, slots released), retried each tick
        self.pending: list[dict[str, Any]] = []
        #: how many of them the settles-pending gauge counts for this process's path now
        self.pending_shown = 0
        #: grants detached from the book, given back at the next tick
        self._closing: list[Grant] = []
        #: the op (capacity, rate, limit, expiry) each key was last taken with, for the tick's new slices
        self._templates: dict[str, BucketOp | CounterOp] = {}
        self.down_since: float | None = None
        #: acquires whose answer was lost (maybe applied), given back once the store answers again
        self.unsure: set[str] = set()
        #: units admitted beyond the slices while the store was cut off, per key (partition tolerance)
        self.overspent: dict[str, float] = {}
        self._last_tick = clock()
        self._renewed_at = self._last_tick
        self._task: asyncio.Task | None = None
        #: one top-up at a time: requests that missed together wait for the first one's slices
        self._topping = asyncio.Lock()
        self._closed = False
        #: a reload came: the slices held go back before the next admission, under `_topping` (a
        #: top-up in flight computed its costs from them and must find them there)
        self._stale = False
        #: requests admitted from memory, top-ups taken, requests admitted beyond the slices while cut off
        self.stats = {"local": 0, "topups": 0, "partition": 0}

    # --- admission -------------------------------------------------------------------------------

    def admit_local(
        self, buckets: list[rl.RateCheck], conc: list[rl.ConcurrencyCheck], counters: list[CounterOp], now: float
    ) -> list[BucketView] | None:
        """Admit from the slices and slots held, without a store call; None when they do not cover it."""
        needs = self._needs(buckets, counters)
        if self._stale or not self.book.fits(needs):
            return None
        taken: list[SlotPool] = []
        for cc in conc:
            pool = self.slots.get(cc.op.key)
            if pool is None or pool.limit != cc.limit or not pool.take():
                for p in taken:
                    p.release()
                return None
            taken.append(pool)
        for key, units, _ in needs:
            self.book.consume(key, units, now)
        self.stats["local"] += 1
        LOCAL_ADMITS.inc()
        self._ensure_ticking()
        return [self.book.bucket_view(b.op.key, b.op, now) for b in buckets]

    def _needs(self, buckets: list[rl.RateCheck], counters: list[CounterOp]) -> list[tuple[str, float, float]]:
        """(key, units, limit) of every bucket and counter op of a request, in that order."""
        needs = [(b.op.key, b.op.cost, b.op.capacity) for b in buckets]
        return needs + [(c.key, float(c.cost), self.limit(c)) for c in counters]

    async def admit_remote(
        self, buckets: list[rl.RateCheck], conc: list[rl.ConcurrencyCheck], counters: list[CounterOp], now: float
    ) -> tuple[AcquireResult, list[BucketView]]:
        """Admit with a top-up from the store (see the module). Returns the store's answer (refused:
        its denials index `buckets`, `counters` and `conc` as a per-request acquire's would) and, when
        admitted, the buckets as the client sees them.

        Raises:
            StoreUnavailable: the store is cut off and the partition bound (if any) does not cover it.
        """
        self._ensure_ticking()
        async with self._topping:
            self.drop_stale()
            views = self.admit_local(buckets, conc, counters, now)
            if views is not None:  # a top-up that ran meanwhile covered this request too
                return AcquireResult(True, views, [], []), views
            await self.give_back_closing(now)
            return await self._admit_remote(buckets, conc, counters, now)

    async def _admit_remote(
        self, buckets: list[rl.RateCheck], conc: list[rl.ConcurrencyCheck], counters: list[CounterOp], now: float
    ) -> tuple[AcquireResult, list[BucketView]]:
        for op in [b.op for b in buckets] + counters:
            self._reset_if_changed(op)
        pools = [self.pool(cc) for cc in conc]
        free = [p.take() for p in pools]
        lacking = [i for i, ok in enumerate(free) if not ok]
        # the units held that this request will take are set aside while the store is asked: a request
        # admitted from memory meanwhile (no lock) must not spend what the top-up counted on
        needs = self._needs(buckets, counters)
        aside = self.book.set_aside(needs)
        try:
            try:
                if self.down_since is not None and self.partition is not None:
                    # cut off: no request waits for the store's timeout; the ticks watch for its return
                    raise StoreUnavailable("the state store is cut off")
                result, slot_ids = await self._top_up(buckets, conc, counters, lacking, now, aside)
            finally:
                self.book.put_back(needs, aside)
        except StoreUnavailable:
            _release(p for p, ok in zip(pools, free, strict=True) if ok)
            return self.admit_partitioned(buckets, conc, counters, lacking, now)
        except BaseException:  # cancelled (the client went away): the held slots it took are free again
            _release(p for p, ok in zip(pools, free, strict=True) if ok)
            raise
        self.down_since = None
        new = dict(zip(lacking, slot_ids, strict=True))
        for i, slot_id in new.items():
            if slot_id is not None:
                pools[i].add(slot_id)
        if not result.ok:  # the slots this request took stay held, free for the next one
            _release(p for i, p in enumerate(pools) if free[i] or new.get(i) is not None)
            return result, []
        for b in buckets:
            self.book.consume(b.op.key, b.op.cost, now)
        for c in counters:
            self.book.consume(c.key, c.cost, now)
        return result, [self.book.bucket_view(b.op.key, b.op, now) for b in buckets]

    async def _top_up(
        self,
        buckets: list[rl.RateCheck],
        conc: list[rl.ConcurrencyCheck],
        counters: list[CounterOp],
        lacking: list[int],
        now: float,
        aside: list[float],
    ) -> tuple[AcquireResult, list[str | None]]:
        """`aside`: the units of each op (buckets', then counters') set aside for this request."""
        slot_ids = [f"{self._instance}.slot.{token_hex(8)}" for _ in lacking]
        slots = [(sid, conc[i].op) for i, sid in zip(lacking, slot_ids, strict=True)]
        sized = self._grant_ops(buckets, counters, now, aside, exact=False)
        exact = self._grant_ops(buckets, counters, now, aside, exact=True)
        if slots:
            (grant_result, grant), slot_results = await self._take_with_slots(sized, slots, now)
        else:  # no task to make (a memory store answers without suspending)
            (grant_result, grant), slot_results = await self._take(*sized, now), []
        used = sized
        if not grant_result.ok and sized != exact:
            # the store has too little for slices: take only what this request needs (the
            # per-request answer), and hold slices of what is needed for a while (contention)
            for op in [*sized[0], *sized[1]]:
                ks = self.book.keys.get(op.key)
                if ks is not None and op.cost:
                    ks.contended_until = now + self.settings.slice_s
            try:
                grant_result, grant = await self._take(*exact, now)
            except BaseException:  # the slots taken are nobody's: they go back, as in `_take_with_slots`
                self._give_back_slots(slots, slot_results, now)
                raise
            used = exact
        if grant_result.ok and grant is not None:
            self.stats["topups"] += 1
            TOPUPS.inc()
        self._observe(grant_result, used[0], used[1], now)
        denials = list(grant_result.denials)
        for i, r in zip(lacking, slot_results, strict=True):
            denials += [Denial("lease", i, None)] if not r.ok else []
        # a counter's use before this request, as a per-request acquire reads it: the store's value
        # less what this process holds and has not admitted (set aside for this request included)
        held = [self.book.state(c.key, self.limit(c)).left + got for c, got in zip(counters, aside[len(buckets) :], strict=True)]  # fmt: skip
        counts = [v - int(h) for v, h in zip(grant_result.counters, held, strict=True)]
        result = AcquireResult(not denials, grant_result.buckets, counts, denials)
        return result, [sid if r.ok else None for sid, r in zip(slot_ids, slot_results, strict=True)]

    async def _take_with_slots(
        self, sized: tuple[list[BucketOp], list[CounterOp]], slots: list[tuple[str, LeaseOp]], now: float
    ) -> tuple[tuple[AcquireResult, Grant | None], list[AcquireResult]]:
        """The grant's acquire and each slot's, at once. When one of them fails (a cut), the slots the
        store granted go back with the next tick that reaches it, instead of staying held by nobody
        until their TTL; one it refused holds nothing, one whose answer was lost is `_reclaim_unsure`'s.
        Raises the first failure."""
        calls = [self._take(*sized, now), *(self._acquire(sid, [], [op], [], now) for sid, op in slots)]
        tasks = [asyncio.ensure_future(c) for c in calls]
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:  # a cancelled top-up too: gather has let every task finish by then
            failed = [t for t in tasks if not t.done() or t.cancelled() or t.exception() is not None]
            if failed:
                answered = [t.result() if t not in failed else None for t in tasks[1:]]
                self._give_back_slots(slots, answered, now)
        for t in failed:
            raise t.exception() or asyncio.CancelledError()
        return tasks[0].result(), [t.result() for t in tasks[1:]]

    def _give_back_slots(self, slots: list[tuple[str, LeaseOp]], answers: Sequence[AcquireResult | None], now: float) -> None:
        """Release, with the next tick that reaches the store, the slots it granted to a top-up that
        failed: only those (None: no answer, and `_reclaim_unsure` gives it back if it was applied)."""
        for (sid, op), answer in zip(slots, answers, strict=True):
            if answer is not None and answer.ok:
                self.pending.append(settle_args(sid, release=[op.key], now=now))

    def _grant_ops(
        self, buckets: list[rl.RateCheck], counters: list[CounterOp], now: float, aside: list[float], *, exact: bool
    ) -> tuple[list[BucketOp], list[CounterOp]]:
        """Every op of the request, each costing what this process lacks of it (0: what was set aside
        for the request covers it), grown to a slice's size unless `exact`."""
        # a slice's size counts what is held, set aside included: it is what the process holds after
        # the top-up (never above `max_share`), the top-up taking the difference
        b_ops = []
        for b, got in zip(buckets, aside[: len(buckets)], strict=True):
            op = b.op
            need = op.cost - got
            held = self.book.state(op.key, op.capacity).left + got
            size = op.cost if exact else self.book.size(op.key, op.cost, op.capacity, now, held)
            cost = max(0.0, size - held) if need > 1e-9 else 0.0
            b_ops.append(BucketOp(op.key, op.capacity if cost else _UNCHECKED, op.rate_per_s, cost))
        c_ops = []
        for c, got in zip(counters, aside[len(buckets) :], strict=True):
            need = c.cost - got
            held = self.book.state(c.key, self.limit(c)).left + got
            size = c.cost if exact else self.book.size(c.key, c.cost, self.limit(c), now, held)
            cost = max(0, math.ceil(size - held)) if need > 0 else 0
            c_ops.append(CounterOp(c.key, c.limit if cost else None, cost, c.expires_at))
        return b_ops, c_ops

    async def _take(self, b_ops: list[BucketOp], c_ops: list[CounterOp], now: float) -> tuple[AcquireResult, Grant | None]:
        """One store acquire of a grant's slices (journaled: a dead process's slices go back), held
        in the book at once."""
        result, grant = await self._take_unheld(b_ops, c_ops, now)
        if grant is not None:
            self._hold(grant, b_ops, c_ops, now)
        return result, grant

    async def _take_unheld(
        self, b_ops: list[BucketOp], c_ops: list[CounterOp], now: float
    ) -> tuple[AcquireResult, Grant | None]:
        """The store acquire of `_take`; the grant is not in the book yet (`_hold` puts it there)."""
        for op in [*b_ops, *c_ops]:
            if op.cost:
                self._templates[op.key] = op
        if not any(op.cost for op in [*b_ops, *c_ops]):
            return await self._store.acquire(
                lease_id=f"{self._instance}.peek", lease_ttl_s=0.0, buckets=b_ops, leases=[], counters=c_ops, now=now,
                urgent=True,
            ), None  # fmt: skip
        grant = Grant(f"{self._instance}.slice.{token_hex(8)}")
        result = await self._acquire(grant.id, b_ops, [], c_ops, now)
        if not result.ok:
            return result, None
        for op in b_ops:
            if op.cost:
                grant.buckets[op.key] = op
        for c in c_ops:
            if c.cost:
                grant.counters[c.key] = c
        return result, grant

    def _hold(self, grant: Grant, b_ops: list[BucketOp], c_ops: list[CounterOp], now: float) -> None:
        """Admit from a grant's slices (what its acquire's ops took) from now on."""
        for op in b_ops:
            if op.cost:
                self.book.add(grant, op.key, op.cost, op.capacity, now)
        for c in c_ops:
            if c.cost:
                self.book.add(grant, c.key, float(c.cost), self.limit(c), now)

    async def _acquire(
        self, lease_id: str, b_ops: list[BucketOp], leases: list[LeaseOp], c_ops: list[CounterOp], now: float
    ) -> AcquireResult:
        """One journaled acquire of slices or a slot. One whose answer was lost (a timeout in a cut)
        may have been applied: its id is kept, and `_reclaim_unsure` gives it back once the store answers.
        Urgent, as every store call of the lease path: its caller holds the top-up lock."""
        journal = Journal(self._instance, [op.key for op in leases], [c for c in c_ops if c.cost], [b for b in b_ops if b.cost])
        try:
            return await self._store.acquire(
                lease_id=lease_id, lease_ttl_s=self._lease_ttl_s, buckets=b_ops, leases=leases, counters=c_ops,
                now=now, journal=journal, urgent=True,
            )  # fmt: skip
        except (StoreUnavailable, asyncio.CancelledError):  # answer lost, or cut short by a shutdown
            self.unsure.add(lease_id)
            raise

    def _observe(self, result: AcquireResult, b_ops: list[BucketOp], c_ops: list[CounterOp], now: float) -> None:
        """Remember what the store had after an acquire (headers, and how big the next slices may be)."""
        for op, view in zip(b_ops, result.buckets, strict=True):
            ks = self.book.keys.get(op.key)
            if ks is not None and op.rate_per_s > 0:
                ks.level, ks.ts = view.reset_s * op.rate_per_s, now
                ks.store_left = ks.limit - ks.level
        for c, value in zip(c_ops, result.counters, strict=True):
            ks = self.book.keys.get(c.key)
            if ks is not None:
                ks.store_left = ks.limit - value

    def counter_levels(self, ops: list[CounterOp]) -> list[int | None]:
        """Each counter's level as this process sees it: the store's value at its last acquire, less
        the units held here and not admitted, plus what it admitted beyond them while cut off. What
        other processes hold counts as used. None: never seen in the store."""
        levels: list[int | None] = []
        for op in ops:
            ks = self.book.keys.get(op.key)
            if ks is None or ks.store_left is None:
                levels.append(None)
            else:
                held = ks.left + ks.aside
                levels.append(round(ks.limit - ks.store_left - held + self.overspent.get(op.key, 0.0)))
        return levels

    def _reset_if_changed(self, op: BucketOp | CounterOp) -> None:
        """A limit changed (a key's own limits edited): the units taken under the old one go back with
        the next tick; the other keys' slices are untouched."""
        limit = op.capacity if isinstance(op, BucketOp) else self.limit(op)
        ks = self.book.keys.get(op.key)
        if ks is not None and ks.limit != limit:
            self.book.forget(op.key)

    def pool(self, cc: rl.ConcurrencyCheck) -> SlotPool:
        pool = self.slots.get(cc.op.key)
        if pool is None:
            pool = self.slots[cc.op.key] = SlotPool(cc.limit, self._clock())
        pool.limit = cc.limit
        return pool
