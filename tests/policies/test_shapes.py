"""Check shapes (policies/admission/shapes.py): built once per key, config and UTC day, rebuilt when
any of them changes, so a cached shape never checks a request against yesterday's quota counters, a
reloaded tenant's old limits or a key's old limits; and the slices counted per key give back exactly
what is held."""

from __future__ import annotations

import msgspec
import pytest

from policies.admission.shapes import Shapes
from policies.errors import NeverAdmitted, QuotaExceeded, RateLimited
from policies.leases import LeaseSettings
from policies.leases.slices import Grant, SliceBook
from policies.stores.base import BucketOp, CounterOp
from policies.stores.memory import MemoryStore
from policies.types import Limits, Quotas, TenantSpec
from tests.policies.helpers import ACME, admission

SPEC = TenantSpec(
    limits=Limits(requests_per_minute=100, tokens_per_minute=1000, max_concurrency=5),
    quotas=Quotas(tokens_per_day=5000, requests_per_month=50),
    key_limits=Limits(tokens_per_minute=800),
)


def test_only_the_tokens_vary_between_requests_of_one_shape(clock) -> None:
    shape = Shapes().of(ACME, SPEC, clock())
    a, b = shape.checks(10), shape.checks(30)
    assert [x.op.cost for x in a.buckets] == [1.0, 10.0, 10.0]
    assert [x.op.cost for x in b.buckets] == [1.0, 30.0, 30.0]
    assert [op.cost for op in a.quota_ops] == [10, 1] and [op.cost for op in b.quota_ops] == [30, 1]
    assert [x.op.key for x in a.buckets] == ["rl:t:acme:rpm", "rl:t:acme:tpm", "rl:k:0123456789ab:tpm"]
    assert a.leases is b.leases and a.quota_checks is b.quota_checks
    # a request of no tokens takes the shape's own lists, which the next request still finds intact
    assert [x.op.cost for x in shape.checks(0).buckets] == [1.0, 0.0, 0.0]


def test_a_request_above_a_limit_is_never_admitted(clock) -> None:
    shape = Shapes().of(ACME, SPEC, clock())
    with pytest.raises(NeverAdmitted, match="tokens_per_minute limit of key 0123456789ab"):
        shape.checks(801)
    assert shape.checks(800).buckets[2].op.cost == 800.0


def test_a_new_shape_after_midnight_a_reload_or_a_key_edit(clock) -> None:
    shapes = Shapes()
    first = shapes.of(ACME, SPEC, clock())
    assert shapes.of(ACME, SPEC, clock() + 60) is first
    clock.advance(14 * 3600)  # 10:00 -> 00:00 the next UTC day
    next_day = shapes.of(ACME, SPEC, clock())
    assert next_day is not first and next_day.day == "2026-11-22" and first.day == "2026-11-21"
    assert next_day.checks(1).quota_checks[0].key != first.checks(1).quota_checks[0].key
    reloaded = msgspec.structs.replace(SPEC, limits=Limits(requests_per_minute=1))
    assert shapes.of(ACME, reloaded, clock()) is not next_day
    edited = msgspec.structs.replace(ACME, limits=Limits(tokens_per_minute=10))
    assert shapes.of(edited, reloaded, clock()).checks(5).buckets[-1].op.capacity == 10.0


@pytest.mark.parametrize("leases", [None, LeaseSettings()], ids=["per_request", "leases"])
async def test_admission_follows_a_reload_and_midnight(clock, leases) -> None:  # noqa: ANN001
    adm = admission(MemoryStore(), clock, limits=Limits(requests_per_minute=2), quotas=Quotas(requests_per_day=3), leases=leases)  # fmt: skip
    for _ in range(2):
        await adm.reconcile(await adm.admit(ACME, "m", 0), 0)
    with pytest.raises(RateLimited):
        await adm.admit(ACME, "m", 0)
    adm.update_tenants({"acme": TenantSpec(limits=Limits(requests_per_minute=10), quotas=Quotas(requests_per_day=3))})
    r = await adm.admit(ACME, "m", 0)  # the reload's limit, not the cached one
    assert r.day == "2026-11-21"
    await adm.reconcile(r, 0)
    with pytest.raises(QuotaExceeded):  # three today
        await adm.admit(ACME, "m", 0)
    clock.advance(14 * 3600)
    r = await adm.admit(ACME, "m", 0)  # a new day's quota counter
    assert r.day == "2026-11-22"
    await adm.reconcile(r, 0)
    await adm.close()


def test_slices_counted_per_key_give_back_exactly_what_is_held() -> None:
    book = SliceBook(slice_s=1.0, max_share=0.5)
    rpm = BucketOp("rl:a:rpm", 100.0, 100 / 60, 0.0)
    day = CounterOp("q:a:d", 1000, 0, 9e9)
    first, second = Grant("g1"), Grant("g2")
    # as `LeasePath._take` records them: each op costing what its grant took
    first.buckets[rpm.key] = msgspec.structs.replace(rpm, cost=10.0)
    first.counters[day.key] = msgspec.structs.replace(day, cost=20)
    second.buckets[rpm.key] = msgspec.structs.replace(rpm, cost=5.0)
    book.add(first, rpm.key, 10.0, 100.0, 0.0)
    book.add(first, day.key, 20.0, 1000.0, 0.0)
    book.add(second, rpm.key, 5.0, 100.0, 0.0)
    for _ in range(12):  # more than the first grant brought of rpm: the key's units, whichever grant
        assert book.fits([(rpm.key, 1.0, 100.0), (day.key, 1.0, 1000.0)])
        book.consume(rpm.key, 1.0, 0.0)
        book.consume(day.key, 1.0, 0.0)
    assert book.refund(day.key, 4.0, day) and not book.refund("q:unknown", 1.0, day)
    assert not book.fits([(rpm.key, 4.0, 100.0)])
    back: dict[str, float] = {}
    grants = book.take_all()
    assert {g.id for g in grants} == {"g1", "g2"}  # every grant settles: each one's journal is dropped
    for g in grants:
        buckets, counters = g.give_back()
        for op in [*buckets, *counters]:
            back[op.key] = back.get(op.key, 0.0) - op.cost
    assert back == {rpm.key: 3.0, day.key: 12.0}
    assert book.keys[rpm.key].left == 0.0 and not book.open


def test_a_refund_to_a_key_with_no_open_grant_takes_one_of_its_own() -> None:
    book = SliceBook(slice_s=1.0, max_share=0.5)
    tpm = BucketOp("rl:a:tpm", 100.0, 100 / 60, 0.0)
    g = Grant("g1")
    g.buckets[tpm.key] = tpm
    book.add(g, tpm.key, 10.0, 100.0, 0.0)
    book.take_all()
    assert book.refund(tpm.key, 6.0, BucketOp(tpm.key, 100.0, 100 / 60, -6.0))
    (refund_grant,) = book.take_all()
    assert refund_grant.id.startswith("refund.") and refund_grant.give_back()[0][0].cost == -6.0
