"""The ticks of a `LeasePath`: every `flush_s`, the slices' unused units go back, the ledger's batch
and the released slots are written, held slots renewed, fresh slices taken for the keys in use; and
the settlement of a leased request, its close at shutdown and its reset at a reload."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog

from policies.errors import StoreUnavailable
from policies.leases.metrics import LEASE_SETTLES_PENDING
from policies.leases.slices import Grant
from policies.stores.base import AcquireResult, BucketOp, CounterOp

log = structlog.get_logger(__name__)


def settle_args(settle_id: str, *, buckets: list[BucketOp] | None = None, release: list[str] | None = None,
                counters: list[CounterOp] | None = None, now: float) -> dict[str, Any]:  # fmt: skip
    """The keyword arguments of a store settle that gives units or slots back and records no usage."""
    return dict(settle_id=settle_id, lease_id=settle_id, buckets=buckets or [], release=release or [],
                counters=counters or [], usage=[], now=now)  # fmt: skip


class Ticking:
    """The tick half of `LeasePath` (its state is set up there)."""

    def settle(self, settle: dict[str, Any]) -> None:
        """A leased request ended: its slots are free, its refunds go back to a slice held (admitted
        from here at once, given back to the store with it), the rest joins the next batch (the
        ticks that write it start with the first request, admitted from the slices or not)."""
        self._ensure_ticking()
        for key in settle["release"]:
            pool = self.slots.get(key)
            if pool is not None:
                pool.release()
        buckets = [b for b in settle["buckets"] if not (b.cost < 0 and self.book.refund(b.key, -b.cost, b))]
        counters = [c for c in settle["counters"] if not (c.cost < 0 and self.book.refund(c.key, -c.cost, c))]
        self.ledger.add(buckets, counters, settle["usage"])

    async def flush(self, *, retake: bool = True) -> None:
        """One tick: take fresh slices for the keys used since the last tick, give every older slice's
        unused units back, write the ledger's batch, release idle slots, renew held slots.

        Fresh slices first, while requests go on admitting from the old ones, so the book is never
        empty and no request waits for the tick (the store must have room for both for a moment; when
        it has not, the old ones go back first and the fresh ones are taken after, in the same hold
        of the top-up lock, so requests waiting on it find them). Slices are given back between two
        top-ups, never during one: a top-up computed its costs from the slices held and must find them
        there, and must see the store with them given back (else it would refuse what a per-request
        acquire admits). While the store is cut off, the tick only asks whether it is back, outside
        that lock, so that requests never wait on it."""
        now = self._clock()
        async with self._topping:
            self.drop_stale()
            active = self.book.tick(now - self._last_tick, now)
            self._last_tick = now
            fresh = await self._take_fresh(active, now) if retake and active and self.down_since is None else None
            going_back = self._close_tick(now)
            if fresh is not None:
                self._hold_fresh(*fresh, going_back, now)
            applied = self.down_since is None and await self._apply_pending(now)
            if fresh is None and applied:
                self._count_back(going_back)
            retook = fresh is not None
            if not retook and applied and retake and active:  # no room for both: after the give-back,
                await self._retake(active, now)  # before the lock goes (requests waiting find the slices)
                retook = True
        if self.down_since is not None:
            self._show_pending()  # the settles this tick added wait for the store with the others
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
        if retake and active and not retook:
            await self._retake(active, now)

    def _close_tick(self, now: float) -> dict[str, float]:
        """With `_topping` held: every slice leaves the book, and its give-back, the ledger's batch and
        the idle slots' releases join the pending settles. Returns the units going back per key."""
        # what keys no longer in use leave behind goes, so memory follows the keys in use
        self._templates = {k: op for k, op in self._templates.items() if k in self.book.keys}
        self.slots = {k: p for k, p in self.slots.items() if p.held or p.busy or p.extra}
        going_back = self._give_back(self.book.take_all() + self._closing, now)
        self._closing = []
        batch = self.ledger.drain(now)
        if batch is not None:
            self.pending.append(batch)
        for key, pool in self.slots.items():
            for sid in pool.surplus(now, self.settings.slot_idle_s):
                self.pending.append(settle_args(sid, release=[key], now=now))
        return going_back

    def _give_back(self, grants: list[Grant], now: float) -> dict[str, float]:
        """Put the settles giving back `grants`' unused units with the pending ones; the units per key."""
        going_back: dict[str, float] = {}
        for g in grants:
            buckets, counters = g.give_back()
            self.pending.append(settle_args(g.id, buckets=buckets, counters=counters, now=now))
            for key, units in g.back.items():
                going_back[key] = going_back.get(key, 0.0) + units
        return going_back

    async def give_back_closing(self, now: float) -> None:
        """With `_topping` held, before a top-up: the slices a reload detached go back now, so that
        the top-up finds the store without this process's own stale units (a refusal they alone
        caused would send its caller away until the period ends). A store that does not answer
        leaves them pending, as at a tick."""
        if self._closing and self.down_since is None:
            going_back = self._give_back(self._closing, now)
            self._closing = []
            if await self._apply_pending(now):
                self._count_back(going_back)

    async def _apply_pending(self, now: float) -> bool:
        """Apply the pending settles (each at most once, by its id); False while the store is cut off.

        A settle that fails with an error other than StoreUnavailable (the stores turn their own
        database and script errors into that, so this is a defect in building that one write) stays
        pending and is tried again at each tick, logged each time; the store answered, so the path
        goes on as connected rather than as cut off (which, with partition tolerance on, would admit
        from the bound alone and refuse every request once it ran out). An outage's charges stay
        counted against the partition bound until the batch that carries them is written."""
        if not self.pending:
            self.down_since = None
            self._charged_overspent()
            self._show_pending()
            return True
        # kept in `pending` until answered: a tick cancelled meanwhile (a shutdown) leaves them for
        # `close` to apply again, which is harmless (each at most once, by its id)
        todo = list(self.pending)
        try:
            answers = await self._store.settle_many(todo, urgent=True)
        except StoreUnavailable as exc:  # none of them reached the store
            answers = [exc] * len(todo)
        done = {id(s) for s, a in zip(todo, answers, strict=True) if not isinstance(a, BaseException)}
        self.pending = [s for s in self.pending if id(s) not in done]
        self._show_pending()
        cut_off = False
        for a in answers:
            if isinstance(a, StoreUnavailable):
                cut_off = True
            elif isinstance(a, BaseException):
                log.error("lease_settle_failed", error=repr(a))
        if self.pending:
            log.warning("lease_settles_deferred", pending=len(self.pending))
        if cut_off:
            if self.down_since is None:
                self.down_since = now
            return False
        self.down_since = None
        if not self.pending:  # an outage's charges ride in the batch: counted here until it is written
            self._charged_overspent()
        return True

    def _charged_overspent(self) -> None:
        """The outage's charges are in the store now: what it was last seen to have left is less by
        them (slice sizes, budget levels), and they are no longer counted beside it."""
        for key, units in self.overspent.items():
            ks = self.book.keys.get(key)
            if ks is not None and ks.store_left is not None:
                ks.store_left -= units
        self.overspent.clear()

    def _show_pending(self) -> None:
        """Bring the settles-pending gauge (one for every path of the process) to this path's count."""
        LEASE_SETTLES_PENDING.inc(len(self.pending) - self.pending_shown)
        self.pending_shown = len(self.pending)

    def _fresh_ops(self, keys: list[str], now: float) -> tuple[list[BucketOp], list[CounterOp]]:
        """A slice's worth of each key in use, as it was last taken (none for a key contended now)."""
        ops = [self._templates[k] for k in keys if k in self._templates]
        b_ops = [BucketOp(o.key, o.capacity, o.rate_per_s, float(self.book.size(o.key, 0, o.capacity, now, 0.0)))
                 for o in ops if isinstance(o, BucketOp)]  # fmt: skip
        c_ops = [CounterOp(o.key, o.limit, self.book.size(o.key, 0, self.limit(o), now, 0.0), o.expires_at)
                 for o in ops if isinstance(o, CounterOp)]  # fmt: skip
        return [b for b in b_ops if b.cost], [c for c in c_ops if c.cost]

    async def _take_fresh(self, keys: list[str], now: float) -> tuple[AcquireResult, Grant, list[BucketOp], list[CounterOp]] | None:
        """With the old slices still held: fresh ones for the keys in use, not yet in the book. None
        when the store has no room for both: the tick then gives back first. A store that does not
        answer is cut off from now on (the tick asks whether it is back outside the top-up lock,
        rather than waiting for it again under it); any other failure leaves the tick to go on as
        when there was no room, so the batch and the give-backs are still written."""
        b_ops, c_ops = self._fresh_ops(keys, now)
        if not (b_ops or c_ops):
            return None
        try:
            result, grant = await self._take_unheld(b_ops, c_ops, now)
        except StoreUnavailable:
            self.down_since = now
            return None
        except Exception:  # noqa: BLE001 - the rest of the tick must still run
            log.exception("lease_fresh_slices_failed")
            return None
        if grant is None:  # what the store has left, for the sizes of the slices taken after the give-back
            self._observe(result, b_ops, c_ops, now)
            return None
        return result, grant, b_ops, c_ops

    def _hold_fresh(
        self, result: AcquireResult, grant: Grant, b_ops: list[BucketOp], c_ops: list[CounterOp],
        going_back: dict[str, float], now: float,
    ) -> None:  # fmt: skip
        """After `_close_tick`: admit from the fresh slices. The store's answer counted the old slices
        too, which are on their way back (`going_back`, units per key): what each key's headers and
        next slice sizes read from that answer is corrected by them."""
        self._hold(grant, b_ops, c_ops, now)
        self._observe(result, b_ops, c_ops, now)
        self._count_back(going_back)

    def _count_back(self, going_back: dict[str, float]) -> None:
        """What the store was last seen to have (headers, slice sizes) plus the units a tick gives back
        (`level` is read for buckets only: a counter's stays 0)."""
        for key, back in going_back.items():
            ks = self.book.keys.get(key)
            if ks is None:
                continue
            ks.level = max(0.0, ks.level - back)
            if ks.store_left is not None:
                ks.store_left += back

    async def _retake(self, keys: list[str], now: float) -> None:
        """Fresh slices for the keys in use, in one acquire (none when the store has too little)."""
        b_ops, c_ops = self._fresh_ops(keys, now)
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
                self.pending.append(settle_args(sid, release=[key], now=now))
        await self.flush(retake=False)
        self._closed = False  # a request after this (a drain's last ones) starts ticking again

    def reset(self) -> None:
        """A reload: the slices taken under the old limits go back at the next tick, and none is
        admitted from meanwhile (they leave the book at the next admission or tick, under the lock)."""
        self._stale = True

    def drop_stale(self) -> None:
        """After a reload, with `_topping` held: the slices held leave the book, to go back at the tick."""
        if self._stale:
            self._stale = False
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


    async def _reclaim_unsure(self, now: float) -> None:
        """Give back the acquires whose answer was lost: one applied left its journal under this
        process (the store holds a journal exactly when the acquire was applied); one not applied left
        nothing, and nothing is given back for it."""
        found = [(rid, j) for rid, j in await self._store.orphans(1e18) if rid in self.unsure]
        for rid, j in found:
            buckets = [BucketOp(b.key, b.capacity, b.rate_per_s, -b.cost) for b in j.buckets]
            counters = [CounterOp(c.key, None, -c.cost, c.expires_at) for c in j.counters]
            await self._store.settle(**settle_args(rid, buckets=buckets, release=j.leases, counters=counters, now=now))
        if found:
            log.warning("lease_lost_answers_given_back", count=len(found))
        self.unsure.clear()
