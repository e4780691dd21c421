"""`LeasePath`: admission from slices held in memory, settlement in batches, partition tolerance.

The common request touches no store: its units come from slices this process took ahead (one store
acquire per slice, `slices.py`), its concurrency from slots it holds (`slots.py`), and its settlement
goes to a ledger written every `flush_s` (`ledger.py`). A request the slices cannot cover takes a
top-up: one acquire of every op of the request, each costing what this process lacks (what it needs
less what it holds, grown to a slice's size when the store has room): the same yes or no, Retry-After
included, that a per-request acquire would answer, because the store counts the units held here as
used. Every tick gives every slice's unused units back and takes fresh slices for the keys in use, so
the store's journal of a slice never holds units already admitted: the crash recovery of a dead
process gives back exactly what it had not admitted (docs/state.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Callable, Iterable
from secrets import token_hex
from typing import Any

import structlog

from policies import ratelimit as rl
from policies.errors import StoreUnavailable
from policies.leases.ledger import Ledger
from policies.leases.settings import LeaseSettings, PartitionSettings
from policies.leases.slices import Grant, SliceBook
from policies.leases.slots import SlotPool
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


def _settle(settle_id: str, *, buckets: list[BucketOp] | None = None, release: list[str] | None = None,
            counters: list[CounterOp] | None = None, now: float) -> dict[str, Any]:  # fmt: skip
    return dict(settle_id=settle_id, lease_id=settle_id, buckets=buckets or [], release=release or [],
                counters=counters or [], usage=[], now=now)  # fmt: skip


def _release(pools: Iterable[SlotPool]) -> None:
    for p in pools:
        p.release()


class LeasePath:
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
        self._partition = partition
        self._lease_ttl_s = lease_ttl_s
        self.book = SliceBook(settings.slice_s, settings.max_share)
        self.slots: dict[str, SlotPool] = {}
        self.ledger = Ledger(instance)
        #: store settles not yet applied (grants given back, batches, slots released), retried each tick
        self.pending: list[dict[str, Any]] = []
        #: grants detached from the book, given back at the next tick
        self._closing: list[Grant] = []
        #: the op (capacity, rate, limit, expiry) each key was last taken with, for the tick's new slices
        self._templates: dict[str, BucketOp | CounterOp] = {}
        self._down_since: float | None = None
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
        #: requests admitted from memory, top-ups taken, requests admitted beyond the slices while cut off
        self.stats = {"local": 0, "topups": 0, "partition": 0}

    # --- admission -------------------------------------------------------------------------------

    def admit_local(
        self, buckets: list[rl.RateCheck], conc: list[rl.ConcurrencyCheck], counters: list[CounterOp], now: float
    ) -> list[BucketView] | None:
        """Admit from the slices and slots held, without a store call; None when they do not cover it."""
        needs = [(b.op.key, b.op.cost, b.op.capacity) for b in buckets]
        needs += [(c.key, float(c.cost), float(c.limit or 0)) for c in counters]
        if not self.book.fits(needs):
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
        self._ensure_ticking()
        return [self.book.bucket_view(b.op.key, b.op, now) for b in buckets]

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
            views = self.admit_local(buckets, conc, counters, now)
            if views is not None:  # a top-up that ran meanwhile covered this request too
                return AcquireResult(True, views, [], []), views
            return await self._admit_remote(buckets, conc, counters, now)

    async def _admit_remote(
        self, buckets: list[rl.RateCheck], conc: list[rl.ConcurrencyCheck], counters: list[CounterOp], now: float
    ) -> tuple[AcquireResult, list[BucketView]]:
        for op in [b.op for b in buckets] + counters:
            self._reset_if_changed(op)
        pools = [self._pool(cc) for cc in conc]
        free = [p.take() for p in pools]
        lacking = [i for i, ok in enumerate(free) if not ok]
        try:
            if self._down_since is not None and self._partition is not None:
                # cut off: no request waits for the store's timeout; the ticks watch for its return
                raise StoreUnavailable("the state store is cut off")
            result, slot_ids = await self._top_up(buckets, conc, counters, lacking, now)
        except StoreUnavailable:
            _release(p for p, ok in zip(pools, free, strict=True) if ok)
            return self._partitioned(buckets, conc, counters, lacking, now)
        self._down_since = None
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
    ) -> tuple[AcquireResult, list[str | None]]:
        slot_ids = [f"{self._instance}.slot.{token_hex(8)}" for _ in lacking]
        slot_calls = [self._acquire(sid, [], [conc[i].op], [], now) for i, sid in zip(lacking, slot_ids, strict=True)]
        sized = self._grant_ops(buckets, counters, now, exact=False)
        exact = self._grant_ops(buckets, counters, now, exact=True)
        if slot_calls:
            answers = await asyncio.gather(self._take(*sized, now), *slot_calls)
            (grant_result, grant), slot_results = answers[0], answers[1:]
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
            grant_result, grant = await self._take(*exact, now)
            used = exact
        if grant_result.ok and grant is not None:
            self.stats["topups"] += 1
        self._observe(grant_result, used[0], used[1], now)
        denials = list(grant_result.denials)
        for i, r in zip(lacking, slot_results, strict=True):
            denials += [Denial("lease", i, None)] if not r.ok else []
        counts = [v - int(self.book.state(c.key, self._limit(c)).left) for v, c in zip(grant_result.counters, counters, strict=True)]  # fmt: skip
        result = AcquireResult(not denials, grant_result.buckets, counts, denials)
        return result, [sid if r.ok else None for sid, r in zip(slot_ids, slot_results, strict=True)]

    def _grant_ops(
        self, buckets: list[rl.RateCheck], counters: list[CounterOp], now: float, *, exact: bool
    ) -> tuple[list[BucketOp], list[CounterOp]]:
        """Every op of the request, each costing what this process lacks of it (0: it holds enough)."""
        b_ops = []
        for b in buckets:
            op = b.op
            left = self.book.state(op.key, op.capacity).left
            size = op.cost if exact else self.book.size(op.key, op.cost, op.capacity, now)
            cost = max(0.0, size - left) if left + 1e-9 < op.cost else 0.0
            b_ops.append(BucketOp(op.key, op.capacity if cost else _UNCHECKED, op.rate_per_s, cost))
        c_ops = []
        for c in counters:
            left = self.book.state(c.key, self._limit(c)).left
            size = c.cost if exact else self.book.size(c.key, c.cost, self._limit(c), now)
            cost = max(0, math.ceil(size - left)) if left < c.cost else 0
            c_ops.append(CounterOp(c.key, c.limit if cost else None, cost, c.expires_at))
        return b_ops, c_ops

    async def _take(self, b_ops: list[BucketOp], c_ops: list[CounterOp], now: float) -> tuple[AcquireResult, Grant | None]:
        """One store acquire of a grant's slices (journaled: a dead process's slices go back)."""
        for op in [*b_ops, *c_ops]:
            if op.cost:
                self._templates[op.key] = op
        if not any(op.cost for op in [*b_ops, *c_ops]):
            return await self._store.acquire(
                lease_id=f"{self._instance}.peek", lease_ttl_s=0.0, buckets=b_ops, leases=[], counters=c_ops, now=now
            ), None  # fmt: skip
        grant = Grant(f"{self._instance}.slice.{token_hex(8)}")
        result = await self._acquire(grant.id, b_ops, [], c_ops, now)
        if not result.ok:
            return result, None
        for op in b_ops:
            if op.cost:
                grant.buckets[op.key] = op
                self.book.add(grant, op.key, op.cost, op.capacity, now)
        for c in c_ops:
            if c.cost:
                grant.counters[c.key] = c
                self.book.add(grant, c.key, float(c.cost), float(c.limit or 0), now)
        return result, grant

    async def _acquire(
        self, lease_id: str, b_ops: list[BucketOp], leases: list[LeaseOp], c_ops: list[CounterOp], now: float
    ) -> AcquireResult:
        """One journaled acquire of slices or a slot. One whose answer was lost (a timeout in a cut)
        may have been applied: its id is kept, and `_reclaim_unsure` gives it back once the store answers."""
        journal = Journal(self._instance, [op.key for op in leases], [c for c in c_ops if c.cost], [b for b in b_ops if b.cost])
        try:
            return await self._store.acquire(
                lease_id=lease_id, lease_ttl_s=self._lease_ttl_s, buckets=b_ops, leases=leases, counters=c_ops,
                now=now, journal=journal,
            )  # fmt: skip
        except StoreUnavailable:
            self.unsure.add(lease_id)
            raise

    async def _reclaim_unsure(self, now: float) -> None:
        """Give back the acquires whose answer was lost: one applied left its journal under this
        process (the store holds a journal exactly when the acquire was applied); one not applied left
        nothing, and nothing is given back for it."""
        found = [(rid, j) for rid, j in await self._store.orphans(1e18) if rid in self.unsure]
        for rid, j in found:
            buckets = [BucketOp(b.key, b.capacity, b.rate_per_s, -b.cost) for b in j.buckets]
            counters = [CounterOp(c.key, None, -c.cost, c.expires_at) for c in j.counters]
            await self._store.settle(**_settle(rid, buckets=buckets, release=j.leases, counters=counters, now=now))
        if found:
            log.warning("lease_lost_answers_given_back", count=len(found))
        self.unsure.clear()

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

    @staticmethod
    def _limit(op: CounterOp) -> float:
        return float(op.limit or 0)

    def _reset_if_changed(self, op: BucketOp | CounterOp) -> None:
        """A limit changed (a reload, a key's own limits): the slices taken under the old one go back."""
        limit = op.capacity if isinstance(op, BucketOp) else self._limit(op)
        ks = self.book.keys.get(op.key)
        if ks is not None and ks.limit != limit:
            self._closing += self.book.detach_key(op.key)
            del self.book.keys[op.key]

    def _pool(self, cc: rl.ConcurrencyCheck) -> SlotPool:
        pool = self.slots.get(cc.op.key)
        if pool is None:
            pool = self.slots[cc.op.key] = SlotPool(cc.limit, self._clock())
        pool.limit = cc.limit
        return pool

    # --- the store cut off -----------------------------------------------------------------------

    def _partitioned(
        self,
        buckets: list[rl.RateCheck],
        conc: list[rl.ConcurrencyCheck],
        counters: list[CounterOp],
        lacking: list[int],
        now: float,
    ) -> tuple[AcquireResult, list[BucketView]]:
        """Admit beyond the slices, within `state.partition`'s bound, or raise StoreUnavailable."""
        p = self._partition
        if self._down_since is None:
            self._down_since = now
        if p is None or now - self._down_since > p.max_seconds:
            raise StoreUnavailable("the state store is unreachable and the slices held do not cover the request")
        extra: list[tuple[BucketOp | CounterOp, float, float]] = []  # (op, units beyond the slices, limit)
        for op, limit in [(b.op, b.op.capacity) for b in buckets] + [(c, self._limit(c)) for c in counters]:
            ks = self.book.keys.get(op.key)
            left = ks.left if ks is not None and ks.limit == limit else 0.0
            if left < op.cost:
                extra.append((op, op.cost - left, limit))
        over = [op.key for op, units, limit in extra if self.overspent.get(op.key, 0.0) + units > limit * p.max_overspend_fraction]  # fmt: skip
        pools = [self._pool(conc[i]) for i in lacking]
        over += [pool_key for pool_key, pool in zip([conc[i].op.key for i in lacking], pools, strict=True)
                 if pool.extra + 1 > math.floor(pool.limit * p.max_overspend_fraction)]  # fmt: skip
        if over:
            raise StoreUnavailable(f"the state store is unreachable and the partition bound is reached for {over[0]}")
        for op, units, _ in extra:
            self.overspent[op.key] = self.overspent.get(op.key, 0.0) + units
        for op, _, limit in [(b.op, 0, b.op.capacity) for b in buckets] + [(c, 0, self._limit(c)) for c in counters]:
            ks = self.book.keys.get(op.key)
            if ks is not None and ks.limit == limit:
                self.book.consume(op.key, min(ks.left, op.cost), now)
        # what was admitted beyond the slices is charged to the store when it answers again
        self.ledger.add(
            [BucketOp(op.key, op.capacity, op.rate_per_s, units) for op, units, _ in extra if isinstance(op, BucketOp)],
            [CounterOp(op.key, None, int(units), op.expires_at) for op, units, _ in extra if isinstance(op, CounterOp)],
            [],
        )  # fmt: skip
        self.ledger.pending -= 1  # a charge, not a request
        for pool in pools:
            pool.extra += 1
        self.stats["partition"] += 1
        views = [BucketView(0.0, 0.0) for _ in buckets]
        return AcquireResult(True, views, [0 for _ in counters], []), views

    # --- settlement ------------------------------------------------------------------------------

    def settle(self, settle: dict[str, Any]) -> None:
        """A leased request ended: its slots are free, its refunds go back to a slice held (admitted
        from here at once, given back to the store with it), the rest joins the next batch."""
        for key in settle["release"]:
            pool = self.slots.get(key)
            if pool is not None:
                pool.release()
        buckets = [b for b in settle["buckets"] if not (b.cost < 0 and self.book.refund(b.key, -b.cost))]
        counters = [c for c in settle["counters"] if not (c.cost < 0 and self.book.refund(c.key, -c.cost))]
        self.ledger.add(buckets, counters, settle["usage"])

    async def flush(self, *, retake: bool = True) -> None:
        """One tick: give every slice's unused units back, write the ledger's batch, release idle slots,
        renew held ones; then take fresh slices for the keys used since the last tick.

        The slices are given back between two top-ups, never during one: a top-up computed its costs
        from the slices held and must find them there, and must see the store with them given back
        (else it would refuse what a per-request acquire admits). While the store is cut off, the
        tick only asks whether it is back, outside that lock, so that requests never wait on it."""
        now = self._clock()
        async with self._topping:
            active = self.book.tick(now - self._last_tick, now)
            self._last_tick = now
            for g in self.book.take_all() + self._closing:
                buckets, counters = g.give_back()
                self.pending.append(_settle(g.id, buckets=buckets, counters=counters, now=now))
            self._closing = []
            batch = self.ledger.drain(now)
            if batch is not None:
                self.pending.append(batch)
            for key, pool in self.slots.items():
                for sid in pool.surplus(now, self.settings.slot_idle_s):
                    self.pending.append(_settle(sid, release=[key], now=now))
            applied = self._down_since is None and await self._apply_pending(now)
        if self._down_since is not None:
            await self._store.ping()  # StoreUnavailable: still cut off
            async with self._topping:
                applied = await self._apply_pending(now)
        if not applied:
            return
        if self.unsure:
            await self._reclaim_unsure(now)
        if now - self._renewed_at > self._lease_ttl_s / 3:
            self._renewed_at = now
            for key, pool in self.slots.items():
                for sid in pool.held:
                    await self._store.renew(lease_id=sid, keys=[key], ttl_s=self._lease_ttl_s, now=now)
        if retake and active:
            await self._retake(active, now)

    async def _apply_pending(self, now: float) -> bool:
        """Apply the pending settles (each at most once, by its id); False while the store is cut off."""
        if not self.pending:
            self._down_since = None
            self.overspent.clear()
            return True
        todo, self.pending = self.pending, []
        answers = await asyncio.gather(*(self._store.settle(**s) for s in todo), return_exceptions=True)
        self.pending = [s for s, a in zip(todo, answers, strict=True) if isinstance(a, BaseException)] + self.pending
        for a in answers:
            if isinstance(a, BaseException) and not isinstance(a, StoreUnavailable):
                log.error("lease_settle_failed", error=repr(a))
        if self.pending:
            log.warning("lease_settles_deferred", pending=len(self.pending))
            if self._down_since is None:
                self._down_since = now
            return False
        self._down_since = None
        self.overspent.clear()  # the outage's charges are in the store now
        return True

    async def _retake(self, keys: list[str], now: float) -> None:
        """Fresh slices for the keys in use, in one acquire (none when the store has too little)."""
        ops = [self._templates[k] for k in keys if k in self._templates]
        b_ops = [BucketOp(o.key, o.capacity, o.rate_per_s, float(self.book.size(o.key, 0, o.capacity, now)))
                 for o in ops if isinstance(o, BucketOp)]  # fmt: skip
        c_ops = [CounterOp(o.key, o.limit, self.book.size(o.key, 0, self._limit(o), now), o.expires_at)
                 for o in ops if isinstance(o, CounterOp)]  # fmt: skip
        b_ops, c_ops = [b for b in b_ops if b.cost], [c for c in c_ops if c.cost]
        if not (b_ops or c_ops):
            return
        with contextlib.suppress(StoreUnavailable):
            result, _ = await self._take(b_ops, c_ops, now)
            self._observe(result, b_ops, c_ops, now)

    async def close(self) -> None:
        """Shutdown: stop ticking, give back every slice and idle slot, write the last batch."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        now = self._clock()
        for key, pool in self.slots.items():
            for sid in pool.take_all():
                self.pending.append(_settle(sid, release=[key], now=now))
        await self.flush(retake=False)
        self._closed = False  # a request after this (a drain's last ones) starts ticking again

    def reset(self) -> None:
        """A reload: the slices taken under the old limits go back at the next tick."""
        self._closing += self.book.take_all()

    def _ensure_ticking(self) -> None:
        if self._task is None and not self._closed:
            self._task = asyncio.get_running_loop().create_task(self._ticks())

    async def _ticks(self) -> None:
        # `_closed`, not the cancel alone: a store client may turn a cancel into its own error
        while not self._closed:
            await asyncio.sleep(self.settings.flush_s)
            try:
                await self.flush()
            except StoreUnavailable as exc:
                log.warning("lease_tick_store_unavailable", error=exc.detail)
            except Exception:  # noqa: BLE001 - a tick must never stop the ticking
                log.exception("lease_tick_failed")
