"""Budgets on the lease path: money admitted from slices held in memory, exact across replicas, alert
levels that do not count the slices held here, a dead replica's money slices given back, and the
partition bound holding for money as for tokens (policies/admission/leased.py, docs/pricing.md)."""

from __future__ import annotations

import asyncio

import pytest

from policies.admission import Admission
from policies.budgets import BudgetCheck, BudgetEvent
from policies.errors import BudgetExceeded
from policies.leases import LeaseSettings, PartitionSettings
from policies.stores import StateStore, open_store
from policies.types import Budget, TenantSpec
from tests.policies.helpers import ACME, CutStore, admit_until_cut_off

LEASES = LeaseSettings()
PRICE = 10_000  # 0.01 USD a request: exactly 100 fit in the 1.00 USD day
DAY_KEY = "b:t:acme:usd:d:2026-11-21"


class Sink:
    def __init__(self) -> None:
        self.events: list[BudgetEvent] = []
        self.levels: list[int] = []

    def level(self, check: BudgetCheck, used_micros: int) -> None:
        if check.key == DAY_KEY:
            self.levels.append(used_micros)

    def announce(self, event: BudgetEvent) -> None:
        self.events.append(event)


def budgeted(store: StateStore, clock, **kwargs: object) -> Admission:  # noqa: ANN001
    spec = TenantSpec(budget=Budget(usd_per_day=1.0))
    return Admission(store, {"acme": spec}, clock, leases=LEASES, **kwargs)


async def _answer(adm: Admission) -> bool:
    """One request at PRICE, answered and settled at it; False when a budget refuses it."""
    try:
        r = await adm.admit(ACME, "m", 1, cost_micros=PRICE)
    except BudgetExceeded:
        return False
    await adm.reconcile(r, 1, cost_micros=PRICE)
    return True


async def _rounds(adms: list[Admission], clock, requests: int, per_round: int = 10) -> int:  # noqa: ANN001
    """Bursts of `per_round` requests on each replica, a tick of each between bursts (so slices grow
    to the observed rate); how many were answered."""
    answered = 0
    for _ in range(0, requests, per_round * len(adms)):
        results = await asyncio.gather(*(_answer(adm) for adm in adms for _ in range(per_round)))
        answered += sum(results)
        clock.advance(0.2)
        for adm in adms:
            await adm.leases.flush()
    return answered


async def test_money_is_admitted_from_slices_and_exact_across_replicas(replicas, clock) -> None:
    """Two replicas, 1.00 USD a day, 300 requests of 0.01: exactly 100 answered, most of them from
    memory, and the recorded spend is exactly 1.00 USD."""
    adms = [budgeted(await replicas(), clock) for _ in range(2)]
    assert await _rounds(adms, clock, 300) == 100
    local = sum(a.leases.stats["local"] for a in adms)
    assert local > 50, local  # slices of money, not a store call per request
    for adm in adms:
        await adm.close()
    (day,) = [r for r in await adms[0].usage("acme") if r.period == "2026-11-21"]
    assert (day.requests, day.cost_usd) == (100, 1.0)
    with pytest.raises(BudgetExceeded, match="is spent"):  # nothing held anywhere: the store says spent
        await Admission(adms[0]._store, {"acme": TenantSpec(budget=Budget(usd_per_day=1.0))}, clock).admit(
            ACME, "m", 1, cost_micros=1
        )


async def test_alert_levels_do_not_count_the_slices_held_here(clock) -> None:
    """Thresholds pass at the request that passes them, although the process holds slices of money
    ahead (0.10 USD each): the level is the store's less what this process holds unadmitted."""
    sink = Sink()
    adm = budgeted(await open_store("memory://"), clock, budget_thresholds=[0.5, 0.8], budget_sink=sink)
    passed_at: dict[float, int] = {}
    for i in range(1, 91):
        assert await _answer(adm)
        await adm.budget_watch.settled()
        for e in sink.events:
            passed_at.setdefault(e.threshold, i)
        if i % 10 == 0:
            clock.advance(0.2)
            await adm.leases.flush()
    assert adm.leases.book.keys[DAY_KEY].left > 0 and adm.leases.stats["local"] > 40
    assert passed_at == {0.5: 50, 0.8: 80}
    await adm.close()


async def test_a_dead_replicas_money_slices_are_given_back(replicas, clock) -> None:
    """A replica answers 25 requests, holds money slices and dies (no tick after its last batch):
    once its heartbeat lapses the survivor admits exactly the 75 left."""
    dead, alive = budgeted(await replicas(), clock, instance="dead"), budgeted(await replicas(), clock, instance="alive")
    await dead.heartbeat(10)
    await alive.heartbeat(1000)
    assert await _rounds([dead], clock, 25, per_round=5) == 25
    assert dead.leases.book.keys[DAY_KEY].left > 0  # slices out at the "kill"
    dead.leases._task.cancel()  # noqa: SLF001 - "kill -9": no more ticks, nothing given back
    clock.advance(11)
    await alive.recover()
    assert await _rounds([alive], clock, 150) == 75
    await alive.close()
    (day,) = [r for r in await alive.usage("acme") if r.period == "2026-11-21"]
    assert (day.requests, day.cost_usd) == (100, 1.0)


async def test_a_cut_overspends_money_at_most_the_partition_bound(clock) -> None:
    """With the store cut, a budget admits the slice it holds and at most 10 % of itself beyond it,
    refuses cleanly past that, and the spend recorded once the store is back equals the answers."""
    inner = await open_store("memory://")
    store = CutStore(inner)
    part = PartitionSettings(max_overspend_fraction=0.1, max_seconds=30)
    adm = budgeted(store, clock, partition=part)  # type: ignore[arg-type]
    before = await _rounds([adm], clock, 40)
    held = adm.leases.book.keys[DAY_KEY].left
    store.cut = True
    during = await admit_until_cut_off(adm, 1, cost_micros=PRICE, most=100)
    assert len(during) == held // PRICE + 10  # the slices held, then 0.10 USD beyond them
    store.cut = False
    for r in during:
        await adm.reconcile(r, 1, cost_micros=PRICE)
    await adm.close()
    (day,) = [r for r in await inner.usage("acme") if r.period == "2026-11-21"]
    assert day.requests == before + len(during)
    assert day.cost_usd == pytest.approx((before + len(during)) * PRICE / 1e6, abs=1e-9)


async def test_a_threshold_passed_between_two_admissions_is_announced(replicas, clock) -> None:
    """Another replica's spend moves the level between two admissions here (read at the next tick's
    acquire): the next admission announces the threshold it passed meanwhile."""
    sink = Sink()
    here = budgeted(await replicas(), clock, budget_thresholds=[0.5], budget_sink=sink)
    there = budgeted(await replicas(), clock)  # announces nothing itself
    assert await _rounds([here], clock, 45, per_round=5) == 45
    await here.budget_watch.settled()
    assert sink.events == []
    assert await _rounds([there], clock, 10, per_round=5) == 10
    await there.close()
    clock.advance(0.2)
    await here.leases.flush()  # its fresh slices' acquire sees the other's spend
    assert await _answer(here)
    await here.budget_watch.settled()
    assert [e.threshold for e in sink.events] == [0.5]
    await here.close()


async def test_levels_count_the_slices_given_back_without_a_retake(clock) -> None:
    """Slices given back by a flush that takes none (a usage read) leave the level right: a refund
    admitted from memory afterwards shows what is spent and reserved, not the slices gone."""
    sink = Sink()
    adm = budgeted(await open_store("memory://"), clock, budget_thresholds=[0.9], budget_sink=sink)
    assert await _rounds([adm], clock, 40) == 40
    in_flight = await adm.admit(ACME, "m", 1, cost_micros=PRICE)
    await adm.usage("acme")  # writes the batch and gives every slice back, takes none
    await adm.reconcile(in_flight, 0, failed=True)  # its 0.01 back into a slice of its own
    assert adm.admit_at_once(ACME, "m", 1, cost_micros=PRICE) is not None  # from memory
    assert sink.levels[-1] == 41 * PRICE  # 40 answered, this one reserved
    await adm.close()


async def test_a_reload_near_the_end_of_a_budget_admits_what_it_left(clock) -> None:
    """After a reload the slices held under the old config go back before the next top-up: with 0.90
    of 1.00 USD answered, a request of 0.10 is admitted, as per request (not refused by this
    process's own stale slices until midnight)."""
    adm = budgeted(await open_store("memory://"), clock)
    assert await _rounds([adm], clock, 90) == 90
    assert adm.leases.book.keys[DAY_KEY].left > 0
    adm.update_tenants({"acme": TenantSpec(budget=Budget(usd_per_day=1.0))})
    last = await adm.admit(ACME, "m", 1, cost_micros=100_000)
    await adm.reconcile(last, 1, cost_micros=100_000)
    with pytest.raises(BudgetExceeded, match="is spent"):
        await adm.admit(ACME, "m", 1, cost_micros=1)
    await adm.close()


async def test_units_set_aside_by_a_top_up_still_count_as_held(clock) -> None:
    """While a top-up waits for the store, the units it set aside for its request are still this
    process's: other requests' budget levels (and headers) do not count them as spent."""
    adm = budgeted(await open_store("memory://"), clock)
    assert await _rounds([adm], clock, 40) == 40
    op = adm.shapes.of(ACME, adm._tenants["acme"], clock()).budgets[0].op(PRICE)  # noqa: SLF001
    before = adm.leases.counter_levels([op])
    need = [(op.key, float(3 * PRICE), adm.leases.limit(op))]
    aside = adm.leases.book.set_aside(need)
    assert aside == [3 * PRICE] and adm.leases.counter_levels([op]) == before
    adm.leases.book.put_back(need, aside)
    assert adm.leases.counter_levels([op]) == before
    await adm.close()
