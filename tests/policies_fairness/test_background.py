"""The background class (batch jobs): only idle capacity, never ahead of an interactive request."""

from __future__ import annotations

import asyncio

from policies.fair_queue import FairQueue, QueueSpec
from tests.policies_fairness.conftest import FakeClock


async def test_background_fills_idle_capacity_up_to_its_limit_and_yields(clock: FakeClock) -> None:
    spec = QueueSpec(policy="vtc", max_concurrency=4, background_max_in_flight=2)
    fq = FairQueue(spec, weights={}, clock=clock)
    batch = [asyncio.ensure_future(fq.acquire("a", 5.0, background=True)) for _ in range(4)]
    await asyncio.sleep(0)
    assert sum(t.done() for t in batch) == 2  # its own limit, though 4 slots are free
    interactive = [await fq.acquire("b", 1.0) for _ in range(2)]  # the other slots are free at once
    waiting = asyncio.ensure_future(fq.acquire("c", 1.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    # a finished batch request's slot goes to the waiting interactive request, not to more batch work
    fq.release(batch[0].result())
    await asyncio.sleep(0)
    assert waiting.done() and not batch[2].done() and not batch[3].done()
    for t in [*interactive, waiting.result()]:
        fq.release(t)
    await asyncio.sleep(0)
    assert batch[2].done() and not batch[3].done()
    # background work is not charged to the tenant's fair share
    assert fq.stats().tenants.get("a") is None or fq.stats().tenants["a"].service == 0


async def test_a_cancelled_background_waiter_leaves_the_queue(clock: FakeClock) -> None:
    fq = FairQueue(QueueSpec(max_concurrency=1), weights={}, clock=clock)
    held = await fq.acquire("b", 1.0)
    waiter = asyncio.ensure_future(fq.acquire("a", 1.0, background=True))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    fq.release(held)
    assert fq.in_flight == 0
    again = await fq.acquire("a", 1.0, background=True)
    assert again.background and fq.in_flight == 1
