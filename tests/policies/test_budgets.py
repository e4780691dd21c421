"""Budgets in USD on every store: reserved at the worst case, settled at the real cost, exact across
replicas, refunded for dead processes; usage rows carry the spend; keys keep their own policy. The
tests of a budget run under both admission strategies: per request and from leases' slices."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from policies.admission import Admission
from policies.budgets import BudgetCheck, BudgetEvent
from policies.errors import BudgetExceeded, NeverAdmitted, RateLimited
from policies.keys import KeyService
from policies.leases import LeaseSettings
from policies.principal import Principal
from policies.stores import StateStore
from policies.types import Budget, Limits, TenantSpec, UsageRow
from tests.policies.helpers import ACME

KEY = Principal("acme", "0123456789ab", ("*",), budget=Budget(usd_per_day=0.5))


def at(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


class Sink:
    def __init__(self) -> None:
        self.events: list[BudgetEvent] = []
        self.levels: list[tuple[str, int]] = []

    def level(self, check: BudgetCheck, used_micros: int) -> None:
        self.levels.append((check.key, used_micros))

    def announce(self, event: BudgetEvent) -> None:
        self.events.append(event)


@pytest.fixture(params=["per_request", "leases"])
def strategy(request: pytest.FixtureRequest) -> LeaseSettings | None:
    """`state.leases` of a budget test's admissions (None: per request, as before leases)."""
    return LeaseSettings() if request.param == "leases" else None


def budgeted(store: StateStore, clock, usd_per_day: float = 1.0, **kwargs: object) -> Admission:  # noqa: ANN001
    spec = TenantSpec(budget=Budget(usd_per_day=usd_per_day, usd_per_month=100.0))
    return Admission(store, {"acme": spec}, clock, **kwargs)


async def test_reserved_at_the_worst_case_settled_at_the_cost(store, clock, strategy) -> None:
    adm = budgeted(store, clock, leases=strategy)
    first = await adm.admit(ACME, "m", 10, cost_micros=600_000)
    # 0.6 reserved: a second worst case of 0.6 does not fit the 1.00 USD day
    with pytest.raises(BudgetExceeded) as refused:
        await adm.admit(ACME, "m", 10, cost_micros=600_000)
    message = refused.value.message
    assert "usd_per_day" in message and "tenant 'acme'" in message and "0.400000 USD left" in message
    assert "2026-11-22T00:00:00Z" in message and refused.value.status == 429
    assert refused.value.code == "budget_exceeded" and "Retry-After" in refused.value.headers
    await adm.reconcile(first, 10, cost_micros=250_000)  # the real cost: 0.35 of the reservation back
    second = await adm.admit(ACME, "m", 10, cost_micros=600_000)
    await adm.reconcile(second, 10, cost_micros=600_000)
    third = await adm.admit(ACME, "m", 10, cost_micros=150_000)  # exactly the rest: 1.00 spent
    await adm.reconcile(third, 10, cost_micros=150_000)
    with pytest.raises(BudgetExceeded, match="is spent"):
        await adm.admit(ACME, "m", 10, cost_micros=1)
    rows = await adm.usage("acme")
    assert [(r.period, r.requests, r.cost_usd) for r in rows] == [("2026-11", 3, 1.0), ("2026-11-21", 3, 1.0)]


async def test_a_failed_request_costs_what_it_used_and_a_new_day_has_a_new_budget(store, clock, strategy) -> None:
    clock.now = at(2026, 11, 21, 23, 0)
    adm = budgeted(store, clock, leases=strategy)
    r = await adm.admit(ACME, "m", 10, cost_micros=900_000)
    await adm.reconcile(r, 0, failed=True)  # nothing used: everything back
    r = await adm.admit(ACME, "m", 10, cost_micros=1_000_000)
    await adm.reconcile(r, 10, cost_micros=1_000_000)
    clock.now = at(2026, 11, 22, 0, 0, 1)
    await adm.admit(ACME, "m", 10, cost_micros=1_000_000)


async def test_a_request_that_can_never_fit_is_a_400(store, clock, strategy) -> None:
    adm = budgeted(store, clock, leases=strategy)
    with pytest.raises(NeverAdmitted, match="more than the budget usd_per_day"):
        await adm.admit(ACME, "m", 10, cost_micros=1_000_001)


async def test_a_keys_own_budget_beside_its_tenants(store, clock, strategy) -> None:
    adm = budgeted(store, clock, leases=strategy)
    await adm.admit(KEY, "m", 1, cost_micros=500_000)
    with pytest.raises(BudgetExceeded, match="key 0123456789ab"):
        await adm.admit(KEY, "m", 1, cost_micros=1)
    await adm.admit(Principal("acme", "ba9876543210"), "m", 1, cost_micros=500_000)
    with pytest.raises(BudgetExceeded, match="tenant 'acme'"):
        await adm.admit(Principal("acme", "ba9876543210"), "m", 1, cost_micros=1)


async def test_a_keys_own_limits_apply_where_its_tenant_has_none(store, clock) -> None:
    adm = Admission(store, {"acme": TenantSpec()}, clock)
    limited = Principal("acme", "0123456789ab", limits=Limits(requests_per_minute=2))
    await adm.admit(limited, "m", 1)
    await adm.admit(limited, "m", 1)
    with pytest.raises(RateLimited, match="key 0123456789ab"):
        await adm.admit(limited, "m", 1)
    await adm.admit(Principal("acme", "ba9876543210"), "m", 1)  # another key: untouched


async def test_spend_is_exact_across_replicas(replicas, clock, strategy) -> None:
    one, two = [budgeted(await replicas(), clock, leases=strategy) for _ in range(2)]
    price = 70_000  # 0.07 USD: 14 fit in 1.00, leaving 0.02

    async def one_request(adm: Admission) -> int:
        try:
            r = await adm.admit(ACME, "m", 1, cost_micros=price)
        except BudgetExceeded:
            return 0
        await adm.reconcile(r, 1, cost_micros=price)
        return 1

    answered = sum(await asyncio.gather(*(one_request(adm) for adm in (one, two) * 15)))
    assert answered == 14
    await two.flush()  # with leases, each process writes its answers every tick
    rows = {r.period: r for r in await one.usage("acme")}
    assert rows["2026-11-21"].cost_usd == pytest.approx(answered * price / 1e6, abs=0)


async def test_a_dead_replicas_reservation_is_refunded(replicas, clock, strategy) -> None:
    dead = budgeted(await replicas(), clock, instance="dead", leases=strategy)
    alive = budgeted(await replicas(), clock, instance="alive", leases=strategy)
    await dead.admit(ACME, "m", 1, cost_micros=800_000)  # never settled: its process is killed
    with pytest.raises(BudgetExceeded):
        await alive.admit(ACME, "m", 1, cost_micros=800_000)
    await alive.heartbeat(60)
    assert await alive.recover() == 1
    r = await alive.admit(ACME, "m", 1, cost_micros=800_000)
    await alive.reconcile(r, 1, cost_micros=800_000)
    assert {r.period: r.cost_usd for r in await alive.usage("acme")}["2026-11-21"] == 0.8


async def test_thresholds_are_announced_once_across_replicas(replicas, clock, strategy) -> None:
    sinks = [Sink(), Sink()]
    adms = [
        budgeted(await replicas(), clock, budget_thresholds=[0.5, 1.0], budget_sink=s, leases=strategy) for s in sinks
    ]
    for i in range(10):
        r = await adms[i % 2].admit(ACME, "m", 1, cost_micros=100_000)
        await adms[i % 2].reconcile(r, 1, cost_micros=100_000)
    with pytest.raises(BudgetExceeded):
        await adms[0].admit(ACME, "m", 1, cost_micros=100_000)
    for adm in adms:
        await adm.budget_watch.settled()
    events = sinks[0].events + sinks[1].events
    # the day's and the month's budgets: 0.5 and 1.0 of the day once each, nothing of the month's 100
    assert sorted((e.budget, e.threshold) for e in events) == [("usd_per_day", 0.5), ("usd_per_day", 1.0)]
    assert all(e.tenant == "acme" and e.key_id is None and e.limit_usd == 1.0 for e in events)


async def test_keys_keep_their_own_limits_and_budget(store, clock) -> None:
    keys = KeyService(store, clock)
    record, secret = await keys.create(
        "acme", limits=Limits(requests_per_minute=5), budget=Budget(usd_per_month=3.5)
    )
    principal = await keys.authenticate(secret)
    assert principal.limits == Limits(requests_per_minute=5) and principal.budget == Budget(usd_per_month=3.5)
    (listed,) = await keys.list("acme")
    assert listed.limits == record.limits and listed.budget == record.budget
    _, plain = await keys.create("acme")
    assert (await keys.authenticate(plain)).budget is None


async def test_usage_rows_sum_costs_exactly(store, clock, strategy) -> None:
    adm = budgeted(store, clock, usd_per_day=1000.0, leases=strategy)
    for cost in (1, 2, 3, 90_000_001):
        r = await adm.admit(ACME, "m", 1, cost_micros=cost)
        await adm.reconcile(r, 1, cost_micros=cost)
    (month, day) = await adm.usage("acme")
    assert month == UsageRow(tenant="acme", model="m", period="2026-11", requests=4, tokens=4, cost_usd=90.000007)
    assert day.cost_usd == 90.000007


async def test_each_key_has_its_usage_rows_per_model_and_deployment(store, clock) -> None:
    adm = Admission(store, {"acme": TenantSpec()}, clock)
    other = Principal("acme", "ba9876543210")
    for who, dep, cost in ((ACME, "gpu", 5), (ACME, "gpu", 7), (ACME, "cpu", 1), (other, "gpu", 2)):
        r = await adm.admit(who, "m", 3, cost_micros=cost)
        await adm.reconcile(r, 3, cost_micros=cost, deployment=dep)
    failed = await adm.admit(ACME, "m", 3)
    await adm.reconcile(failed, 0, failed=True)  # no answer, nothing used: no key row
    rows = [(r.key_id, r.deployment, r.period, r.requests, r.tokens, r.cost_usd) for r in await adm.key_usage("acme")]
    assert rows == [
        ("0123456789ab", "cpu", "2026-11", 1, 3, 1e-6),
        ("0123456789ab", "cpu", "2026-11-21", 1, 3, 1e-6),
        ("0123456789ab", "gpu", "2026-11", 2, 6, 12e-6),
        ("0123456789ab", "gpu", "2026-11-21", 2, 6, 12e-6),
        ("ba9876543210", "gpu", "2026-11", 1, 3, 2e-6),
        ("ba9876543210", "gpu", "2026-11-21", 1, 3, 2e-6),
    ]
    # the tenant's rows are unchanged by the keys' rows beside them
    assert [(r.period, r.requests, r.cost_usd) for r in await adm.usage("acme")] == [
        ("2026-11", 4, 15e-6), ("2026-11-21", 4, 15e-6),
    ]  # fmt: skip
    assert await adm.key_usage("other") == []


async def test_enormous_budgets_and_key_limits_admit_and_settle(store, clock, strategy) -> None:  # noqa: ANN001
    """The largest budgets and limits the admin API and the config accept (1e300 USD, 10**30 a
    minute) are held by every store: a priced request is admitted and settled, and the spend adds."""
    huge = Budget(usd_per_day=1e300, usd_per_month=1e300)
    limits = Limits(requests_per_minute=10**30, tokens_per_minute=10**30, max_concurrency=10**30)
    key = Principal("acme", "0123456789ab", ("*",), limits=limits, budget=huge)
    adm = Admission(store, {"acme": TenantSpec(budget=huge, key_limits=limits)}, clock, leases=strategy)
    for _ in range(2):
        reservation = await adm.admit(key, "m", 10, cost_micros=10**15)
        await adm.reconcile(reservation, 10, cost_micros=10**15)
    (day,) = [r for r in await adm.usage("acme") if len(r.period) == 10]
    assert day.cost_usd == 2e9


async def test_a_refusal_names_a_budget_under_a_cent_as_configured(store, clock, strategy) -> None:  # noqa: ANN001
    adm = budgeted(store, clock, usd_per_day=0.004, leases=strategy)
    first = await adm.admit(ACME, "m", 10, cost_micros=3_000)
    await adm.reconcile(first, 10, cost_micros=3_000)
    with pytest.raises(BudgetExceeded) as refused:
        await adm.admit(ACME, "m", 10, cost_micros=2_000)
    assert "0.003000 of 0.004 USD used or reserved" in refused.value.message  # it read "of 0.00 USD"
    with pytest.raises(NeverAdmitted) as never:
        await adm.admit(ACME, "m", 10, cost_micros=5_000)
    assert "(0.004 USD) can ever hold" in never.value.message
