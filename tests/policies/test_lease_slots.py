"""Concurrency slots of the lease path when one of a top-up's slot acquires fails in a cut: the slots
the store did grant come back with the next tick, not after their TTL, and a slot the store never
granted is never released (policies/leases/path.py, docs/state.md)."""

from __future__ import annotations

from typing import Any

import pytest

from policies.errors import RateLimited, StoreUnavailable
from policies.leases import LeaseSettings
from policies.principal import Principal
from policies.stores import StateStore, open_store
from policies.stores.base import AcquireResult, BucketView, Denial
from policies.types import Limits
from tests.policies.helpers import ACME, admission

OTHER_KEY = Principal("acme", "ffffffffffff", ("*",))


class _SecondSlotFails:
    """A store whose second slot acquire (an acquire holding a concurrency lease) fails once as a
    cut does: before reaching the store, or after it applied the acquire (the answer lost)."""

    def __init__(self, inner: StateStore, *, applied: bool) -> None:
        self.inner, self.applied = inner, applied
        self.slot_acquires = 0

    async def acquire(self, **kwargs: Any) -> Any:  # noqa: ANN401
        if kwargs["leases"]:
            self.slot_acquires += 1
            if self.slot_acquires == 2:
                if self.applied:
                    await self.inner.acquire(**kwargs)
                raise StoreUnavailable("cut")
        return await self.inner.acquire(**kwargs)

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401
        return getattr(self.inner, name)


@pytest.mark.parametrize("applied", [False, True], ids=["not-applied", "answer-lost"])
async def test_slots_of_a_failed_top_up_come_back_at_the_next_tick(clock, applied: bool) -> None:  # noqa: ANN001
    inner = await open_store("memory://")
    store = _SecondSlotFails(inner, applied=applied)
    one = Limits(max_concurrency=1)
    # a tenant slot and a key slot: the top-up takes both at once, and the second one fails
    adm = admission(store, clock, limits=one, key_limits=one, leases=LeaseSettings(slot_idle_s=3600))  # type: ignore[arg-type]
    with pytest.raises(StoreUnavailable):
        await adm.admit(ACME, "m", 0)
    assert adm.leases is not None
    # only the slot the store granted and answered is queued for release: never the failed one
    assert [s["release"] for s in adm.leases.pending] == [["cc:t:acme"]]
    other = admission(inner, clock, limits=one, key_limits=one)  # another replica, per request
    with pytest.raises(RateLimited):  # the slot is still held until the store hears it back
        await other.admit(OTHER_KEY, "m", 0)
    await adm.leases.flush()  # the store answers again: the next tick gives it back
    r = await other.admit(OTHER_KEY, "m", 0)  # the tenant's one slot is free for the other replica
    await other.reconcile(r, 0)
    r = await other.admit(ACME, "m", 0)  # and so is the key's (reclaimed only if it was applied)
    await other.reconcile(r, 0)
    assert adm.leases.pending == [] and adm.leases.unsure == set()


class _SliceRefusedThenCut:
    """A store that refuses a top-up's second slice (too little left for a slice) and is cut off
    when the top-up retries with just what the request needs; slots are granted."""

    def __init__(self, inner: StateStore) -> None:
        self.inner, self.slices = inner, 0

    async def acquire(self, **kwargs: Any) -> Any:  # noqa: ANN401
        if not kwargs["leases"] and any(b.cost for b in kwargs["buckets"]):
            self.slices += 1
            if self.slices == 2:
                views = [BucketView(0.0, 0.0) for _ in kwargs["buckets"]]
                return AcquireResult(False, views, [0 for _ in kwargs["counters"]], [Denial("bucket", 0, 1.0)])
            if self.slices == 3:
                raise StoreUnavailable("cut")
        return await self.inner.acquire(**kwargs)

    def __getattr__(self, name: str) -> Any:  # noqa: ANN401
        return getattr(self.inner, name)


async def test_slot_of_a_top_up_cut_at_its_exact_retry_comes_back(clock) -> None:  # noqa: ANN001
    inner = await open_store("memory://")
    limits = Limits(requests_per_minute=1000, max_concurrency=2)
    adm = admission(_SliceRefusedThenCut(inner), clock, limits=limits, leases=LeaseSettings(slot_idle_s=3600))  # type: ignore[arg-type]
    held = await adm.admit(ACME, "m", 0)  # in flight: its slot stays busy
    with pytest.raises(StoreUnavailable):
        await adm.admit(ACME, "m", 0)  # a second slot granted, then the slice's retry is cut off
    assert adm.leases is not None
    await adm.leases.flush()
    other = admission(inner, clock, limits=limits)  # another replica, per request
    r = await other.admit(OTHER_KEY, "m", 0)  # the second slot came back
    with pytest.raises(RateLimited):  # the first is still held, by the request in flight
        await other.admit(OTHER_KEY, "m", 0)
    await other.reconcile(r, 0)
    await adm.reconcile(held, 0)
