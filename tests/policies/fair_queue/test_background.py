"""The background class (batch jobs): only idle capacity, never ahead of an interactive request."""

from __future__ import annotations

import asyncio

from policies.fair_queue import FairQueue, QueueSpec
from tests.policies.fair_queue.conftest import FakeClock


async def test_background_fills_idle_capacity_and_yields_to_interactive_traffic(clock: FakeClock) -> None:
    spec = QueueSpec(policy="vtc", max_concurrency=4, background_max_in_flight=1, background_idle_s=2.0)
    fq = FairQueue(spec, weights={}, clock=clock)
    batch = [asyncio.ensure_future(fq.acquire("a", 5.0, background=True)) for _ in range(6)]
    await asyncio.sleep(0)
    assert sum(t.done() for t in batch) == 3  # an idle deployment: all but one slot
    first = await fq.acquire("b", 1.0)  # the slot kept free: an interactive arrival never waits for it
    waiting = asyncio.ensure_future(fq.acquire("c", 1.0))
    await asyncio.sleep(0)
    assert not waiting.done()
    # a finished batch request's slot goes to the waiting interactive request, not to more batch work
    fq.release(batch[0].result())
    await asyncio.sleep(0)
    assert waiting.done() and sum(t.done() for t in batch) == 3
    # while interactive traffic is present, batch work drains to `background_max_in_flight`
    fq.release(batch[1].result())
    fq.release(batch[2].result())
    await asyncio.sleep(0)
    assert sum(t.done() for t in batch) == 4 and fq.in_flight == 3
    fq.release(first)
    fq.release(waiting.result())
    clock.advance(1.0)
    fq.release(batch[3].result())
    await asyncio.sleep(0)
    assert sum(t.done() for t in batch) == 5 and fq.in_flight == 1  # seen 1 s ago: still one at a time
    clock.advance(1.5)
    fq.notify()
    await asyncio.sleep(0)
    assert all(t.done() for t in batch) and fq.in_flight == 2  # idle again: the rest goes
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
