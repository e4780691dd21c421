"""A tick takes fresh slices before it gives the old ones back: requests go on admitting from the
old ones meanwhile and never wait for the tick; when the store has no room for both, the old ones go
back first. Either way nothing is admitted twice."""

from __future__ import annotations

import asyncio

from policies.admission import Admission
from policies.errors import RateLimited
from policies.leases import LeaseSettings
from policies.stores.memory import MemoryStore
from policies.types import Limits, TenantSpec
from tests.policies.helpers import ACME

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


async def _the_rest(store: MemoryStore, clock) -> int:  # noqa: ANN001
    """What another replica, asking per request, is still admitted."""
    other = Admission(store, TENANTS, clock)
    admitted = 0
    while True:
        try:
            await other.reconcile(await other.admit(ACME, "m", 0), 0)
        except RateLimited:
            return admitted
        admitted += 1


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
    tick = asyncio.create_task(adm.leases.flush())
    await asyncio.wait_for(store.waiting.wait(), 5)  # the tick's acquire of fresh slices is out
    for _ in range(2):  # admitted from the old slices, with no top-up: nobody waits for the tick
        await adm.reconcile(await asyncio.wait_for(adm.admit(ACME, "m", 0), 5), 0)
        admitted += 1
    assert adm.leases.stats["topups"] == topups and not tick.done()
    store.gate.set()
    await tick
    assert store.calls[-2:] == ["acquire ok", "settle"] or store.calls[-3:-1] == ["acquire ok", "settle"]
    assert adm.leases.book.keys["rl:t:acme:rpm"].left > 0  # the fresh slices
    await adm.leases.flush(retake=False)  # everything held goes back
    assert admitted + await _the_rest(store, clock) == 100
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
    admitted += await _the_rest(store, clock)  # another replica leaves nothing beside the slices held
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
    assert admitted + await _the_rest(store, clock) == 100
    await adm.close()
