"""A tick takes fresh slices before it gives the old ones back: requests go on admitting from the
old ones meanwhile and never wait for the tick; when the store has no room for both, the old ones go
back first. Either way nothing is admitted twice."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from policies.admission import Admission
from policies.errors import RateLimited, StoreUnavailable
from policies.leases import LeaseSettings
from policies.stores.memory import MemoryStore
from policies.types import Limits, TenantSpec
from tests.policies.helpers import ACME, what_another_replica_takes

TENANTS = {"acme": TenantSpec(limits=Limits(requests_per_minute=100))}
#: ticks only when a test asks (`leases.flush()`); slices of at most 30 of the 100
QUIET = LeaseSettings(max_share=0.3, flush_s=1000)


class _Gated(MemoryStore):
    """A memory store whose acquires wait for `gate` while it is closed, and which logs its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.waiting = asyncio.Event()
        self.calls: list[str] = []

    async def acquire(self, **kwargs):  # noqa: ANN003, ANN201
        if not self.gate.is_set():
            self.waiting.set()
            await self.gate.wait()
        result = await super().acquire(**kwargs)
        self.calls.append("acquire " + ("ok" if result.ok else "refused"))
        return result

    async def settle(self, **kwargs):  # noqa: ANN003, ANN201
        self.calls.append("settle")
        return await super().settle(**kwargs)


async def test_requests_admit_from_the_old_slices_while_the_tick_takes_fresh_ones(clock) -> None:
    store = _Gated()
    adm = Admission(store, TENANTS, clock, leases=QUIET)
    admitted = 0
    for _ in range(3):  # slices grow over ticks
        for _ in range(4):
            await adm.reconcile(await adm.admit(ACME, "m", 0), 0)
            admitted += 1
        await adm.leases.flush()
    await adm.reconcile(await adm.admit(ACME, "m", 0), 0)  # the key is in use since the last tick
    admitted += 1
    held = adm.leases.book.keys["rl:t:acme:rpm"].left
    assert held >= 3
    topups = adm.leases.stats["topups"]
    store.gate.clear()
    store.calls.clear()
    tick = asyncio.create_task(adm.leases.flush())
    await asyncio.wait_for(store.waiting.wait(), 5)  # the tick's acquire of fresh slices is out
    for _ in range(2):  # admitted from the old slices, with no top-up: nobody waits for the tick
        await adm.reconcile(await asyncio.wait_for(adm.admit(ACME, "m", 0), 5), 0)
        admitted += 1
    assert adm.leases.stats["topups"] == topups and not tick.done()
    store.gate.set()
    await tick
    assert store.calls[0] == "acquire ok" and set(store.calls[1:]) == {"settle"}  # fresh, then the old back
    assert adm.leases.book.keys["rl:t:acme:rpm"].left > 0  # the fresh slices
    await adm.leases.flush(retake=False)  # everything held goes back
    assert admitted + await what_another_replica_takes(store, TENANTS, clock) == 100
    await adm.close()


async def test_a_store_without_room_for_both_gets_the_old_slices_back_first(clock) -> None:
    store = _Gated()
    adm = Admission(store, TENANTS, clock, leases=QUIET)
    admitted = 0
    for _ in range(3):
        for _ in range(4):
            await adm.reconcile(await adm.admit(ACME, "m", 0), 0)
            admitted += 1
        await adm.leases.flush()
    await adm.reconcile(await adm.admit(ACME, "m", 0), 0)
    admitted += 1
    admitted += await what_another_replica_takes(store, TENANTS, clock)  # another replica leaves nothing beside the slices held
    store.calls.clear()
    await adm.leases.flush()
    # refused with the old slices held; they go back (with the batch); then fresh ones fit
    assert store.calls[0] == "acquire refused" and store.calls[-1] == "acquire ok"
    assert "settle" in store.calls[1:-1]
    while True:  # the fresh slices are admitted from, and not a request beyond the limit
        try:
            await adm.reconcile(await adm.admit(ACME, "m", 0), 0)
        except RateLimited:
            break
        admitted += 1
    await adm.leases.flush(retake=False)
    assert admitted + await what_another_replica_takes(store, TENANTS, clock) == 100
    await adm.close()


async def test_fresh_slices_are_sized_as_if_nothing_were_held(clock) -> None:
    """The old slices are on their way back: counting them too, each roll would grow the slices
    towards the whole of what the store has left, starving the other replicas."""
    tenants = {"acme": TenantSpec(limits=Limits(requests_per_minute=1000))}
    store = MemoryStore()
    other = Admission(store, tenants, clock)
    for _ in range(800):  # another replica leaves 200 of the 1000
        await other.reconcile(await other.admit(ACME, "m", 0), 0)
    adm = Admission(store, tenants, clock, leases=LeaseSettings(flush_s=1000))  # max_share 0.1
    for _ in range(10):
        await adm.reconcile(await adm.admit(ACME, "m", 0), 0)
        await adm.leases.flush()
        assert adm.leases.book.keys["rl:t:acme:rpm"].left <= 0.1 * 200 + 1
    await adm.close()


class _Failing(MemoryStore):
    """A memory store whose slice acquires raise `error` once `failing` is set; logs the other calls."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error, self.failing = error, False
        self.calls: list[str] = []

    async def acquire(self, **kwargs):  # noqa: ANN003, ANN201
        if self.failing and ".slice." in kwargs["lease_id"]:
            self.calls.append("acquire")
            raise self.error
        return await super().acquire(**kwargs)

    async def settle_many(self, settles, *, urgent=False):  # noqa: ANN001, ANN201
        self.calls.append("settle_many")
        if self.failing and isinstance(self.error, StoreUnavailable):
            raise self.error
        return await super().settle_many(settles, urgent=urgent)

    async def ping(self) -> None:
        self.calls.append("ping")
        if self.failing and isinstance(self.error, StoreUnavailable):
            raise self.error


async def _in_use(adm: Admission) -> None:
    for _ in range(3):
        await adm.reconcile(await adm.admit(ACME, "m", 0), 0)
        await adm.leases.flush()
    await adm.reconcile(await adm.admit(ACME, "m", 0), 0)


async def test_a_store_cut_at_the_fresh_acquire_is_not_waited_for_twice_under_the_lock(clock) -> None:
    store = _Failing(StoreUnavailable("cut"))
    adm = Admission(store, TENANTS, clock, leases=QUIET)
    await _in_use(adm)
    store.failing, store.calls = True, []
    with pytest.raises(StoreUnavailable):
        await adm.leases.flush()
    # cut off from its first answer: the tick asks whether it is back (outside the lock), no settle
    assert store.calls == ["acquire", "ping"] and adm.leases.down_since is not None
    assert adm.leases.pending  # the give-backs and the batch wait for the store
    store.failing = False
    await adm.leases.flush(retake=False)
    assert not adm.leases.pending and adm.leases.down_since is None
    await adm.close()


async def test_an_error_on_the_fresh_acquire_still_writes_the_batch(clock) -> None:
    """SQLite passes errors that are not its own through: the tick goes on as when the store had no
    room, so usage is recorded and the old slices go back."""
    store = _Failing(OverflowError("Python int too large to convert to SQLite INTEGER"))
    adm = Admission(store, TENANTS, clock, leases=QUIET)
    await _in_use(adm)
    store.failing, store.calls = True, []
    with contextlib.suppress(OverflowError):  # the retake after the give-back meets it again
        await adm.leases.flush()
    assert store.calls[:2] == ["acquire", "settle_many"]
    assert not adm.leases.pending and not adm.leases.book.open
    assert sum(r.requests for r in await store.usage() if len(r.period) == 10) == 4
    await adm.close()



async def test_two_replicas_rolling_while_admitting_take_exactly_the_limit(replicas, clock) -> None:
    """On every store: ticks roll while requests are admitted beside them, on two replicas."""
    tenants = {"acme": TenantSpec(limits=Limits(tokens_per_minute=1000))}
    settings = LeaseSettings(max_share=0.2, flush_s=1000)
    one = Admission(await replicas(), tenants, clock, leases=settings)
    two = Admission(await replicas(), tenants, clock, leases=settings)
    admitted = 0

    async def take(adm: Admission, tokens: int) -> None:
        nonlocal admitted
        with contextlib.suppress(RateLimited):
            await adm.reconcile(await adm.admit(ACME, "m", tokens), tokens)
            admitted += tokens

    for _ in range(40):
        await asyncio.gather(one.leases.flush(), two.leases.flush(), *(take((one, two)[i % 2], 7) for i in range(6)))
    for adm in (one, two):
        await adm.leases.flush(retake=False)
    admitted += await what_another_replica_takes(await replicas(), tenants, clock, tokens=1)
    assert admitted == 1000
    for adm in (one, two):
        await adm.close()
