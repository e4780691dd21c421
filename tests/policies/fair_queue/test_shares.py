"""Weighted shares for backlogged tenants, the burst bound of a newly active tenant, no banking."""

from __future__ import annotations

import random
from collections import defaultdict

import msgspec
import pytest

from policies.fair_queue import FairQueue, QueueSpec, Ticket
from tests.policies.conftest import FakeClock
from tests.policies.fair_queue.conftest import Sim

MAX_COST = 8.0


def big_spec(policy: str, concurrency: int = 2) -> QueueSpec:
    return QueueSpec(
        policy=policy,  # type: ignore[arg-type]
        max_concurrency=concurrency,
        max_queue_per_tenant=100_000,
        max_queue_total=1_000_000,
        drr_quantum=8.0,
    )


def backlog(tenants: dict[str, int], seed: int, at: float = 0.0) -> list[tuple[float, str, float]]:
    rng = random.Random(seed)
    arrivals = []
    for tenant, n in tenants.items():
        arrivals += [(at, tenant, float(rng.randint(1, int(MAX_COST)))) for _ in range(n)]
    rng.shuffle(arrivals)
    return arrivals


def service_while_all_backlogged(served: list[Ticket]) -> dict[str, float]:
    """Service per tenant over the dispatches made while every tenant still had work queued."""
    last = {}
    for t in served:
        last[t.tenant] = t.dispatch_seq
    end = min(last.values())
    totals: dict[str, float] = defaultdict(float)
    for t in served:
        if t.dispatch_seq <= end:
            totals[t.tenant] += t.cost
    return totals


@pytest.mark.parametrize("policy", ["vtc", "drr"])
async def test_weighted_shares_converge_to_weights(policy: str, clock: FakeClock) -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    fq = FairQueue(big_spec(policy), weights=weights, clock=clock)
    served = await Sim(fq, clock).run(backlog({"a": 1500, "b": 1500, "c": 1500}, seed=1))
    totals = service_while_all_backlogged(served)
    whole = sum(totals.values())
    assert whole > 10_000  # long enough for the shares to mean something
    for tenant, w in weights.items():
        assert totals[tenant] / whole == pytest.approx(w / 6.0, abs=0.01), (tenant, dict(totals))


async def test_fcfs_ignores_weights_and_serves_in_arrival_order(clock: FakeClock) -> None:
    fq = FairQueue(big_spec("fcfs"), weights={"a": 1.0, "b": 5.0}, clock=clock)
    arrivals = [(0.001 * i, "a" if i % 3 else "b", 1.0) for i in range(300)]
    served = await Sim(fq, clock, seconds_per_unit=0.5).run(arrivals)
    assert [t.id for t in served] == sorted(t.id for t in served)
    counts = defaultdict(int)
    for t in served:
        counts[t.tenant] += 1
    assert counts == {"a": 200, "b": 100}


def max_lead(
    served: list[Ticket], newcomer: str, since_seq: int, rivals: tuple[str, ...] = ("a", "b")
) -> float:
    """Largest lead in service of `newcomer` over any rival, over every dispatch prefix from
    `since_seq` while all rivals are still backlogged."""
    end = min(max(t.dispatch_seq for t in served if t.tenant == x) for x in rivals)
    got: dict[str, float] = defaultdict(float)
    lead = 0.0
    for t in served:
        if not since_seq <= t.dispatch_seq <= end:
            continue
        got[t.tenant] += t.cost
        others = [got[x] for x in rivals]
        lead = max(lead, got[newcomer] - min(others))
    return lead


async def newcomer_run(clock: FakeClock, *, idle_first: bool) -> tuple[list[Ticket], int]:
    fq = FairQueue(big_spec("vtc", concurrency=2), weights={}, clock=clock)
    arrivals = backlog({"a": 1200, "b": 1200}, seed=2)
    if idle_first:
        # c was active early, then idle for a long time while a and b kept the deployment busy
        arrivals += backlog({"c": 20}, seed=3)
    arrivals += backlog({"c": 600}, seed=4, at=30.0)
    start = clock.now
    served = await Sim(fq, clock).run(arrivals)
    # the flood must still be going when c returns, or there is nothing to be fair about
    assert max(t.dispatched_at for t in served if t.tenant in "ab") > start + 31.0
    first_new = min(t.dispatch_seq for t in served if t.tenant == "c" and t.enqueued_at >= start + 30.0)
    return served, first_new


@pytest.mark.parametrize("idle_first", [False, True])
async def test_newly_active_tenant_burst_is_bounded(clock: FakeClock, idle_first: bool) -> None:
    served, since = await newcomer_run(clock, idle_first=idle_first)
    # VTC's bound (Sheng et al., Thm. 4.1 for equal weights): a newcomer lifted to the minimum
    # counter leads a backlogged tenant by at most 2 x the largest request cost.
    assert max_lead(served, "c", since) <= 2 * MAX_COST
    # and it is not starved either: it gets about a third of the service while all three wait
    tail = [t for t in served if since <= t.dispatch_seq < since + 600]
    share_c = sum(t.cost for t in tail if t.tenant == "c") / sum(t.cost for t in tail)
    assert share_c == pytest.approx(1 / 3, abs=0.05)


async def test_lift_applies_when_queue_was_empty(clock: FakeClock) -> None:
    """A tenant arriving to an empty queue is lifted to the last tenant that left it."""
    fq = FairQueue(big_spec("vtc", concurrency=1), weights={}, clock=clock)
    sim = Sim(fq, clock)
    # a runs alone for a while (its counter grows to 400), the queue drains, then a and c return
    arrivals = [(0.0, "a", 4.0)] * 100 + [(100.0, "c", 4.0)] * 50 + [(100.0, "a", 4.0)] * 50
    served = await sim.run(arrivals)
    since = min(t.dispatch_seq for t in served if t.tenant == "c")
    assert max_lead(served, "c", since, rivals=("a",)) <= 2 * MAX_COST


async def credit_run(clock: FakeClock, burst: float, idle_s: float) -> tuple[list[Ticket], int]:
    """a and b flood; c sends a little early, goes idle for `idle_s`, then floods too."""
    spec = msgspec.structs.replace(big_spec("vtc", concurrency=2), vtc_burst=burst)
    fq = FairQueue(spec, weights={}, clock=clock)
    arrivals = backlog({"a": 1200, "b": 1200}, seed=2) + backlog({"c": 5}, seed=3)
    arrivals += backlog({"c": 600}, seed=4, at=idle_s)
    start = clock.now
    served = await Sim(fq, clock).run(arrivals)
    first_new = min(t.dispatch_seq for t in served if t.tenant == "c" and t.enqueued_at >= start + idle_s)
    return served, first_new


@pytest.mark.parametrize("burst", [24.0, 64.0])
async def test_vtc_burst_credit_is_used_and_bounded(clock: FakeClock, burst: float) -> None:
    served, since = await credit_run(clock, burst, idle_s=30.0)
    lead = max_lead(served, "c", since)
    # the credit is really spent (beyond what plain VTC allows) and never more than granted
    assert 2 * MAX_COST < lead <= burst + 2 * MAX_COST
    # after the credit is spent, c gets its plain third again
    tail = [t for t in served if since + 100 <= t.dispatch_seq < since + 700]
    share_c = sum(t.cost for t in tail if t.tenant == "c") / sum(t.cost for t in tail)
    assert share_c == pytest.approx(1 / 3, abs=0.05)


async def test_vtc_burst_credit_refills_only_while_idle(clock: FakeClock) -> None:
    """Idle for about one request's worth of time, c has almost no credit to spend."""
    served, since = await credit_run(clock, burst=64.0, idle_s=0.3)
    assert max_lead(served, "c", since) <= 2 * MAX_COST + 8.0


@pytest.mark.parametrize(("burst", "quiet_in_a_row"), [(0.0, 1), (12.0, 3)])
async def test_vtc_burst_lets_a_quiet_burst_through_ahead_of_a_flood(
    clock: FakeClock, burst: float, quiet_in_a_row: int
) -> None:
    spec = msgspec.structs.replace(big_spec("vtc", concurrency=1), vtc_burst=burst)
    fq = FairQueue(spec, weights={}, clock=clock)
    # noisy floods alone for 2 s, then quiet sends 3 requests at once
    arrivals = [(0.0, "noisy", 4.0)] * 200 + [(2.0, "quiet", 4.0)] * 3
    served = await Sim(fq, clock).run(arrivals)
    order = "".join("q" if t.tenant == "quiet" else "n" for t in served)
    first = order.index("q")
    assert order[first : first + quiet_in_a_row] == "q" * quiet_in_a_row
    assert order[first + quiet_in_a_row] == "n"
