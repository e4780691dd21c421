"""Day/month quotas by UTC calendar period, usage rows, reconcile idempotence, on every store."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from policies.errors import QuotaExceeded
from policies.quotas import day_end, month_end
from policies.stores import UsageDelta
from policies.types import Quotas, UsageRow
from tests.policies.helpers import ACME, ACME_KEY2, admission


def at(*args: int) -> float:
    return datetime(*args, tzinfo=UTC).timestamp()


def test_period_ends_are_utc_calendar_boundaries() -> None:
    assert day_end(at(2026, 11, 21, 23, 59, 59)) == at(2026, 11, 22)
    assert day_end(at(2026, 11, 22)) == at(2026, 11, 23)
    assert month_end(at(2026, 11, 21, 10)) == at(2026, 12, 1)
    assert month_end(at(2026, 12, 31, 23)) == at(2027, 1, 1)


async def test_daily_token_quota_with_reset_time(store, clock) -> None:
    clock.now = at(2026, 11, 21, 22, 0)
    adm = admission(store, clock, quotas=Quotas(tokens_per_day=1000))
    r = await adm.admit(ACME, "m", 600)
    with pytest.raises(QuotaExceeded):  # 600 reserved + 500 > 1000 while the first one runs
        await adm.admit(ACME, "m", 500)
    await adm.reconcile(r, 400)  # 200 of the reservation come back
    r2 = await adm.admit(ACME_KEY2, "m", 500)  # quotas are per tenant, across keys
    await adm.reconcile(r2, 500)
    with pytest.raises(QuotaExceeded) as err:
        await adm.admit(ACME, "m", 101)
    e = err.value
    assert e.status == 429 and e.code == "quota_exceeded"
    assert "tokens_per_day" in e.message and "2026-11-22T00:00:00Z" in e.message
    assert "900 of 1000" in e.message
    assert e.retry_after_s == pytest.approx(7200)
    await adm.admit(ACME, "m", 100)  # exactly the rest still fits
    clock.now = at(2026, 11, 22, 0, 0, 1)  # a new UTC day: a fresh budget
    await adm.admit(ACME, "m", 1000)


async def test_monthly_request_quota(store, clock) -> None:
    clock.now = at(2026, 11, 30, 23, 0)
    adm = admission(store, clock, quotas=Quotas(requests_per_month=3, requests_per_day=10))
    for _ in range(3):
        await adm.reconcile(await adm.admit(ACME, "m", 10), 10)
    with pytest.raises(QuotaExceeded) as err:
        await adm.admit(ACME, "m", 10)
    assert "requests_per_month" in err.value.message and "2026-12-01T00:00:00Z" in err.value.message
    failed = None
    clock.now = at(2026, 12, 1, 0, 0)
    for _ in range(3):
        failed = await adm.admit(ACME, "m", 10)
    await adm.reconcile(failed, 0, failed=True)  # an unanswered request gives its quota back
    await adm.admit(ACME, "m", 10)
    with pytest.raises(QuotaExceeded):
        await adm.admit(ACME, "m", 10)


async def test_usage_rows_per_tenant_model_and_period(store, clock) -> None:
    clock.now = at(2026, 11, 21, 23, 59)
    adm = admission(store, clock, quotas=Quotas(tokens_per_month=10**9))
    a = await adm.admit(ACME, "llama", 100)
    b = await adm.admit(ACME, "digits", 1)
    clock.now = at(2026, 11, 22, 0, 1)  # ends after midnight: still charged to the day it started
    await adm.reconcile(a, 70)
    await adm.reconcile(a, 70)
    await adm.reconcile(b, 1)
    c = await adm.admit(ACME, "llama", 10)
    await adm.reconcile(c, 5)
    rows = await adm.usage("acme")
    assert rows == [
        UsageRow(tenant="acme", model="digits", period="2026-11", requests=1, tokens=1),
        UsageRow(tenant="acme", model="digits", period="2026-11-21", requests=1, tokens=1),
        UsageRow(tenant="acme", model="llama", period="2026-11", requests=2, tokens=75),
        UsageRow(tenant="acme", model="llama", period="2026-11-21", requests=1, tokens=70),
        UsageRow(tenant="acme", model="llama", period="2026-11-22", requests=1, tokens=5),
    ]
    assert await adm.usage("other") == []
    assert len(await adm.usage()) == 5


async def test_settle_is_applied_once_per_id_even_from_another_replica(replicas, clock) -> None:
    one, two = await replicas(), await replicas()
    usage = [UsageDelta("acme", "m", "2026-11", 1, 7)]
    kw = dict(lease_id="x", buckets=[], release=[], counters=[], usage=usage, now=clock())
    assert await one.settle(settle_id="s1", **kw) is True
    assert await two.settle(settle_id="s1", **kw) is False
    assert await one.usage() == [UsageRow(tenant="acme", model="m", period="2026-11", requests=1, tokens=7)]


@pytest.mark.parametrize("urgent", [False, True])
async def test_settle_many_answers_each_settle_on_its_own(store, clock, urgent) -> None:
    """The lease ticks' batch of settles: each applied once, a repeated id refused, in order."""
    kw = dict(lease_id="x", buckets=[], release=[], counters=[], now=clock())
    one = dict(settle_id="s1", usage=[UsageDelta("acme", "m", "2026-11", 1, 7)], **kw)
    two = dict(settle_id="s2", usage=[UsageDelta("acme", "m", "2026-11", 2, 5)], **kw)
    assert await store.settle_many([one, one, two], urgent=urgent) == [True, False, True]
    assert await store.settle_many([two], urgent=urgent) == [False]
    assert await store.usage() == [UsageRow(tenant="acme", model="m", period="2026-11", requests=3, tokens=12)]

