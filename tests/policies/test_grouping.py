"""Group commit (SQLite) and pipelining (Redis): concurrent admissions share round trips, stay exact."""

from __future__ import annotations

import asyncio

import pytest

from policies.errors import RateLimited
from policies.types import Limits
from tests.policies.helpers import ACME, admission


@pytest.mark.parametrize("replicas", ["sqlite", "redis"], indirect=True)
async def test_concurrent_admissions_share_commits_and_stay_exact(replicas, clock) -> None:
    first, second = await replicas(), await replicas()  # two replicas of one state
    limit = 50
    gates = [admission(s, clock, limits=Limits(requests_per_minute=limit)) for s in (first, second)]

    async def one(i: int) -> bool:
        try:
            reservation = await gates[i % 2].admit(ACME, "m", 1)
        except RateLimited:
            return False
        await gates[i % 2].reconcile(reservation, 1)
        return True

    admitted = await asyncio.gather(*(one(i) for i in range(3 * limit)))
    assert sum(admitted) == limit  # exact across both replicas, however the work was grouped
    for store in (first, second):
        ops, groups = _grouping(store)
        assert groups < ops  # several operations shared a commit / a round trip
    rows = await first.usage("acme")
    assert sum(r.requests for r in rows if len(r.period) == 10) == limit


def _grouping(store) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    if hasattr(store, "grouped_ops"):
        return store.grouped_ops, store.groups
    return store.pipelined_ops, store.pipelines


@pytest.mark.parametrize("replicas", ["redis"], indirect=True)
async def test_scripts_lost_by_redis_are_loaded_again(replicas, clock) -> None:
    store = await replicas()
    gate = admission(store, clock, limits=Limits(requests_per_minute=10))
    await gate.reconcile(await gate.admit(ACME, "m", 1), 1)
    await store._client.script_flush()  # a restarted Redis holds no scripts
    reservations = await asyncio.gather(*(gate.admit(ACME, "m", 1) for _ in range(3)))
    for r in reservations:
        await gate.reconcile(r, 1)
    rows = await store.usage("acme")
    assert sum(r.requests for r in rows if len(r.period) == 10) == 4
