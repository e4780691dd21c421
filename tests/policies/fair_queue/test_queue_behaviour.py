"""Admission behaviour: work conservation, priorities, deadlines, cancellation, bounded queues."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from policies.fair_queue import FairQueue, QueueDeadlineExceeded, QueueFull, QueueSpec
from tests.policies.fair_queue.conftest import FakeClock, Sim, settle


async def test_work_conserving_under_random_load(clock: FakeClock) -> None:
    spec = QueueSpec(policy="vtc", max_concurrency=3, max_queue_per_tenant=10_000)
    fq = FairQueue(spec, weights={"a": 1.0, "b": 3.0}, clock=clock)
    rng = random.Random(7)
    arrivals, t = [], 0.0
    for _ in range(1500):
        t += rng.expovariate(90.0)  # bursts above and below the ~100 req/s capacity
        arrivals.append((t, rng.choice("abc"), float(rng.randint(1, 6))))
    violations = []

    def check() -> None:
        if fq.depth() > 0 and fq.in_flight < spec.max_concurrency:
            violations.append((clock.now, fq.depth(), fq.in_flight))

    served = await Sim(fq, clock, seconds_per_unit=0.01).run(arrivals, on_event=check)
    assert violations == []
    assert len(served) == 1500
    assert fq.in_flight == 0 and fq.depth() == 0


async def test_priority_orders_requests_inside_a_tenant(clock: FakeClock) -> None:
    fq = FairQueue(QueueSpec(policy="vtc", max_concurrency=1), weights={}, clock=clock)
    held = await fq.acquire("a", 1.0)
    low = asyncio.ensure_future(fq.acquire("a", 1.0, priority=0))
    high = asyncio.ensure_future(fq.acquire("a", 1.0, priority=5))
    mid = asyncio.ensure_future(fq.acquire("a", 1.0, priority=1))
    await settle()
    order = []
    fq.release(held)
    for _ in range(3):
        await settle()
        done = next(t for t in (low, high, mid) if t.done() and t not in order)
        order.append(done)
        fq.release(done.result())
    assert order == [high, mid, low]


async def test_fcfs_priority_does_not_jump_other_tenants(clock: FakeClock) -> None:
    fq = FairQueue(QueueSpec(policy="fcfs", max_concurrency=1), weights={}, clock=clock)
    held = await fq.acquire("x", 1.0)
    a_low = asyncio.ensure_future(fq.acquire("a", 1.0))
    b = asyncio.ensure_future(fq.acquire("b", 1.0))
    a_high = asyncio.ensure_future(fq.acquire("a", 1.0, priority=9))
    await settle()
    order = []
    fq.release(held)
    for _ in range(3):
        await settle()
        done = next(t for t in (a_low, b, a_high) if t.done() and t not in order)
        order.append(done)
        fq.release(done.result())
    # a's high-priority request uses a's place in line; a's second place comes after b
    assert order == [a_high, b, a_low]


async def test_deadline_in_queue_gives_504_and_never_dispatches(clock: FakeClock) -> None:
    fq = FairQueue(QueueSpec(max_concurrency=1), weights={}, clock=clock)
    held = await fq.acquire("a", 1.0)
    late = asyncio.ensure_future(fq.acquire("b", 1.0, timeout_s=5.0))
    on_time = asyncio.ensure_future(fq.acquire("c", 1.0, deadline=clock.now + 50.0))
    await settle()
    clock.advance(6.0)
    fq.notify()
    await settle()
    with pytest.raises(QueueDeadlineExceeded) as info:
        late.result()
    assert info.value.status == 504 and info.value.code == "queue_deadline_exceeded"
    fq.release(held)
    await settle()
    assert on_time.done() and on_time.result().tenant == "c"
    stats = fq.stats().tenants
    assert stats["b"].expired == 1 and stats["b"].dispatched == 0
    assert fq.in_flight == 1 and fq.depth() == 0


async def test_default_deadline_and_expiry_at_dispatch(clock: FakeClock) -> None:
    fq = FairQueue(QueueSpec(max_concurrency=1, default_deadline_s=2.0), weights={}, clock=clock)
    held = await fq.acquire("a", 1.0)
    waiting = asyncio.ensure_future(fq.acquire("b", 1.0))
    await settle()
    clock.advance(3.0)
    fq.release(held)  # the slot frees after the deadline: b must not get it
    await settle()
    with pytest.raises(QueueDeadlineExceeded):
        waiting.result()
    assert fq.in_flight == 0
    with pytest.raises(QueueDeadlineExceeded):  # a deadline already past is refused at once
        await fq.acquire("b", 1.0, deadline=clock.now - 1.0)


async def test_deadline_fires_on_its_own_with_real_clock() -> None:
    fq = FairQueue(QueueSpec(max_concurrency=1), weights={})
    held = await fq.acquire("a", 1.0)
    started = time.monotonic()
    with pytest.raises(QueueDeadlineExceeded):
        await fq.acquire("b", 1.0, timeout_s=0.05)
    assert 0.04 <= time.monotonic() - started < 1.0
    assert fq.depth() == 0
    fq.release(held)
    assert fq.in_flight == 0


async def test_cancelled_waiter_leaves_the_queue_at_once(clock: FakeClock) -> None:
    fq = FairQueue(QueueSpec(max_concurrency=1), weights={}, clock=clock)
    held = await fq.acquire("a", 1.0)
    waiter = asyncio.ensure_future(fq.acquire("b", 3.0))
    await settle()
    assert fq.depth("b") == 1
    waiter.cancel()
    await asyncio.sleep(0)
    assert fq.depth("b") == 0 and fq.depth() == 0
    assert fq.stats().tenants["b"].cancelled == 1
    fq.release(held)
    assert fq.in_flight == 0
    assert fq.stats().tenants["b"].dispatched == 0


async def test_cancel_racing_release_is_skipped(clock: FakeClock) -> None:
    fq = FairQueue(QueueSpec(max_concurrency=1), weights={}, clock=clock)
    held = await fq.acquire("a", 1.0)
    waiter = asyncio.ensure_future(fq.acquire("b", 1.0))
    await settle()
    waiter.cancel()
    fq.release(held)  # same tick: b's handler has not run yet, its future is cancelled
    await settle()
    assert waiter.cancelled()
    assert fq.in_flight == 0 and fq.depth() == 0


async def test_cancel_after_grant_gives_the_slot_back_and_refunds(clock: FakeClock) -> None:
    fq = FairQueue(QueueSpec(max_concurrency=1), weights={}, clock=clock)
    held = await fq.acquire("a", 1.0)
    granted = asyncio.ensure_future(fq.acquire("b", 10.0))
    next_one = asyncio.ensure_future(fq.acquire("c", 1.0))
    await settle()
    fq.release(held)  # b is granted (its future has a result) ...
    granted.cancel()  # ... but the client goes away before b's task resumes
    await settle()
    assert granted.cancelled()
    assert next_one.done() and next_one.result().tenant == "c"
    assert fq.in_flight == 1
    assert fq.stats().tenants["b"].service == 0.0  # the 10 units charged at dispatch came back


async def test_bounded_queues_429_then_503(clock: FakeClock) -> None:
    spec = QueueSpec(max_concurrency=1, max_queue_per_tenant=2, max_queue_total=3)
    fq = FairQueue(spec, weights={}, clock=clock)
    held = await fq.acquire("a", 1.0)  # dispatched at once, not queued
    waiting = [asyncio.ensure_future(fq.acquire("a", 1.0)) for _ in range(2)]
    await settle()
    with pytest.raises(QueueFull) as tenant_full:
        await fq.acquire("a", 1.0)
    assert tenant_full.value.status == 429 and tenant_full.value.code == "tenant_queue_full"
    assert tenant_full.value.retry_after_s is not None and tenant_full.value.retry_after_s > 0
    assert tenant_full.value.headers["Retry-After"].isdigit()
    waiting.append(asyncio.ensure_future(fq.acquire("b", 1.0)))
    await settle()
    with pytest.raises(QueueFull) as full:
        await fq.acquire("c", 1.0)
    assert full.value.status == 503 and full.value.code == "queue_full"
    assert "Retry-After" in full.value.headers
    stats = fq.stats().tenants
    assert stats["a"].rejected_tenant_full == 1 and stats["c"].rejected_queue_full == 1
    for task in waiting:
        task.cancel()
    fq.release(held)


async def test_capacity_callable_gates_dispatch_and_notify_resumes(clock: FakeClock) -> None:
    engine_free = False
    fq = FairQueue(QueueSpec(max_concurrency=2), weights={}, clock=clock, capacity=lambda: engine_free)
    waiters = [asyncio.ensure_future(fq.acquire("a", 1.0)) for _ in range(3)]
    await settle()
    assert fq.in_flight == 0 and fq.depth() == 3
    engine_free = True
    fq.notify()
    await settle()
    assert fq.in_flight == 2 and fq.depth() == 1  # max_concurrency still caps the engine's "yes"
    for task in waiters:
        task.cancel()


async def test_charge_and_reconcile_drive_vtc_order(clock: FakeClock) -> None:
    fq = FairQueue(QueueSpec(policy="vtc", max_concurrency=2), weights={}, clock=clock)
    long_a = await fq.acquire("a", 10.0)
    short_b = await fq.acquire("b", 10.0)
    fq.charge(long_a, 50.0)  # a's long request keeps delivering service
    a_next = asyncio.ensure_future(fq.acquire("a", 1.0))
    b_next = asyncio.ensure_future(fq.acquire("b", 1.0))
    await settle()
    assert fq.depth() == 2
    fq.release(short_b, actual_cost=2.0)  # b's estimate was high: refunded
    await settle()
    # b was lifted to a's counter (60) on queueing, then refunded 8: 52 < 60, so b goes first
    assert b_next.done() and not a_next.done()
    state = fq.stats().tenants
    assert state["a"].virtual == pytest.approx(60.0) and state["b"].virtual == pytest.approx(53.0)
    assert state["b"].service == pytest.approx(3.0)
    fq.release(long_a)
    fq.release(long_a)  # idempotent
    await settle()
    assert a_next.done() and fq.in_flight == 2
    with pytest.raises(ValueError):
        fq.charge(long_a, 1.0)


async def test_drr_serves_by_deficit(clock: FakeClock) -> None:
    gate = False
    spec = QueueSpec(policy="drr", max_concurrency=1, drr_quantum=4.0)
    fq = FairQueue(spec, weights={}, clock=clock, capacity=lambda: gate)
    tasks = [asyncio.ensure_future(fq.acquire("a", 4.0)) for _ in range(3)]
    tasks += [asyncio.ensure_future(fq.acquire("b", 2.0)) for _ in range(6)]
    await settle()
    gate = True
    order = []
    fq.notify()
    for _ in range(9):
        await settle()
        ticket = next(t.result() for t in tasks if t.done() and t.result().dispatch_seq == len(order))
        order.append(ticket.tenant)
        fq.release(ticket)
    assert "".join(order) == "abbabbabb"


async def test_drr_quantum_smaller_than_cost_and_weights(clock: FakeClock) -> None:
    gate = False
    spec = QueueSpec(policy="drr", max_concurrency=1, drr_quantum=0.5)
    fq = FairQueue(spec, weights={"b": 2.0}, clock=clock, capacity=lambda: gate)
    tasks = [asyncio.ensure_future(fq.acquire(t, 100.0)) for t in "ab" * 6]
    await settle()
    gate = True
    fq.notify()
    order = []
    for _ in range(9):
        await settle()
        ticket = next(t.result() for t in tasks if t.done() and t.result().dispatch_seq == len(order))
        order.append(ticket.tenant)
        fq.release(ticket)
    assert order.count("b") == 6 and order.count("a") == 3  # 2:1 by weight, no endless loop
    for task in tasks:
        task.cancel()


async def test_stats_and_weights(clock: FakeClock) -> None:
    fq = FairQueue(QueueSpec(), weights={"a": 2.0}, clock=clock)
    ticket = await fq.acquire("a", 4.0)
    clock.advance(1.0)
    fq.release(ticket, actual_cost=6.0)
    s = fq.stats()
    assert s.policy == "vtc" and s.in_flight == 0 and s.depth == 0
    a = s.tenants["a"]
    assert (a.weight, a.admitted, a.dispatched, a.completed, a.service) == (2.0, 1, 1, 1, 6.0)
    assert a.virtual == pytest.approx(3.0)  # 6 units / weight 2
    fq.update_weights({"a": 1.0})
    assert fq.weight("a") == 1.0 and fq.weight("zzz") == 1.0
    with pytest.raises(ValueError, match="weight"):
        fq.update_weights({"a": 0.0})
    with pytest.raises(ValueError, match="cost"):
        await fq.acquire("a", -1.0)


def test_queue_errors_are_policy_errors() -> None:
    from policies.errors import PolicyError

    err = QueueFull.tenant("acme", 5, retry_after_s=2.5)
    assert isinstance(err, PolicyError)
    assert (err.status, err.code, err.retry_after_s, err.headers["Retry-After"]) == (
        429,
        "tenant_queue_full",
        2.5,
        "3",
    )
    assert "acme" in err.message
    late = QueueDeadlineExceeded("late")
    assert isinstance(late, PolicyError) and late.status == 504 and late.retry_after_s is None


async def test_vtc_tie_after_lift_goes_to_tenant_with_less_in_service(clock: FakeClock) -> None:
    gate = True
    fq = FairQueue(QueueSpec(policy="vtc", max_concurrency=3), weights={}, clock=clock, capacity=lambda: gate)
    flood = [await fq.acquire("noisy", 2.0) for _ in range(3)]
    gate = False  # the engine is full: the next requests queue
    noisy_next = asyncio.ensure_future(fq.acquire("noisy", 2.0))
    await settle()
    quiet = asyncio.ensure_future(fq.acquire("quiet", 2.0))  # lifted to noisy's counter: a tie
    await settle()
    assert fq.stats().tenants["quiet"].virtual == fq.stats().tenants["noisy"].virtual
    gate = True
    fq.release(flood[0])
    await settle()
    assert quiet.done() and not noisy_next.done()
    noisy_next.cancel()


@pytest.mark.parametrize("policy", ["vtc", "drr", "fcfs"])
async def test_passing_through_an_idle_queue_leaves_what_queueing_would(policy: str) -> None:
    """A request that finds nobody waiting and a free slot skips the waiting machinery; the same
    random load run with that fast path switched off must grant, count and charge alike."""

    async def run(pass_through: bool) -> tuple[list, dict, int, int]:
        spec = QueueSpec(policy=policy, max_concurrency=3, drr_quantum=2.0)
        fq = FairQueue(spec, weights={"a": 1.0, "b": 2.0}, clock=FakeClock())
        passed = 0
        fast_path = fq._pass_through

        def counted(*args: object) -> object:
            nonlocal passed
            passed += 1
            return fast_path(*args)  # type: ignore[arg-type]

        fq._pass_through = counted  # type: ignore[method-assign]
        if not pass_through:
            fq._can_pass_through = lambda: False  # type: ignore[method-assign]
        rng = random.Random(11)
        held: list = []
        waiting: list[asyncio.Future] = []
        granted = []
        for _ in range(400):
            if held and rng.random() < 0.5:
                fq.release(held.pop(rng.randrange(len(held))), actual_cost=float(rng.randint(0, 4)))
            else:
                waiting.append(asyncio.ensure_future(fq.acquire(rng.choice("abc"), float(rng.randint(1, 5)))))
            await settle()
            for task in [t for t in waiting if t.done()]:
                waiting.remove(task)
                ticket = task.result()
                held.append(ticket)
                granted.append((ticket.id, ticket.tenant, ticket.cost, ticket.dispatch_seq, ticket.charged))
        stats = {
            t: (s.admitted, s.dispatched, s.in_flight, s.service, s.virtual)
            for t, s in fq.stats().tenants.items()
        }
        return granted, stats, fq.in_flight, passed

    fast, slow = await run(True), await run(False)
    assert fast[:3] == slow[:3]
    assert len(fast[0]) > 100 and fast[3] > 20 and slow[3] == 0  # both paths were taken
