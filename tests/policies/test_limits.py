"""Rate limits on every store: exact smooth token buckets, refunds, concurrency, headers."""

from __future__ import annotations

import pytest

from policies.errors import NeverAdmitted, RateLimited
from policies.ratelimit import format_duration
from policies.types import Limits, Quotas
from tests.policies.helpers import ACME, ACME_KEY2, admission


async def test_requests_per_minute_is_exact_and_smooth(store, clock) -> None:
    adm = admission(store, clock, limits=Limits(requests_per_minute=60))
    for _ in range(60):  # the whole minute may be spent at once ...
        await adm.admit(ACME, "m", 0)
    with pytest.raises(RateLimited) as err:  # ... and not one more
        await adm.admit(ACME, "m", 0)
    assert err.value.status == 429 and err.value.code == "rate_limit_exceeded"
    assert err.value.retry_after_s == pytest.approx(1.0, abs=1e-6)  # one request drains per second
    assert err.value.headers["Retry-After"] == "1"
    assert err.value.headers["x-ratelimit-remaining-requests"] == "0"
    clock.advance(0.999)
    with pytest.raises(RateLimited):
        await adm.admit(ACME, "m", 0)
    clock.advance(0.001)
    await adm.admit(ACME, "m", 0)  # exactly one slot back after 1 s
    with pytest.raises(RateLimited):
        await adm.admit(ACME, "m", 0)
    clock.advance(30)  # half a minute refills half the bucket
    for _ in range(30):
        await adm.admit(ACME, "m", 0)
    with pytest.raises(RateLimited):
        await adm.admit(ACME, "m", 0)


async def test_tokens_reserved_then_refunded_on_reconcile(store, clock) -> None:
    adm = admission(store, clock, limits=Limits(tokens_per_minute=1000))
    first = await adm.admit(ACME, "m", 600)
    assert adm.headers(first)["x-ratelimit-remaining-tokens"] == "400"
    with pytest.raises(RateLimited) as err:
        await adm.admit(ACME, "m", 600)
    assert err.value.retry_after_s == pytest.approx(200 * 60 / 1000, abs=1e-6)
    await adm.reconcile(first, 100)  # 500 reserved tokens were not used: they come back
    second = await adm.admit(ACME, "m", 600)
    assert adm.headers(second)["x-ratelimit-remaining-tokens"] == "300"
    await adm.reconcile(first, 100)  # a second reconcile changes nothing
    with pytest.raises(RateLimited):
        await adm.admit(ACME, "m", 301)
    await adm.admit(ACME, "m", 300)


async def test_overuse_is_charged_and_oversized_request_refused(store, clock) -> None:
    adm = admission(store, clock, limits=Limits(tokens_per_minute=1000))
    r = await adm.admit(ACME, "m", 100)
    assert await adm.check_stream(r, 100) is True
    assert await adm.check_stream(r, 101) is False  # past its reservation: the gateway cuts the stream
    await adm.reconcile(r, 900)  # what was really used is charged, even above the reservation
    with pytest.raises(RateLimited):
        await adm.admit(ACME, "m", 101)
    with pytest.raises(NeverAdmitted) as err:
        await adm.admit(ACME, "m", 1001)  # can never fit: no point retrying
    assert err.value.status == 400 and err.value.code == "request_exceeds_limit"
    assert err.value.retry_after_s is None and "Retry-After" not in err.value.headers
    assert "more than the tokens_per_minute limit of tenant acme (1000) can ever hold" in err.value.message


async def test_a_request_larger_than_any_limit_or_quota_is_never_admitted(store, clock) -> None:
    """400, not a 429 to retry forever: for a key's limit, and for a day's token quota; nothing is
    taken from the store (the request's own small sibling still fits whole)."""
    adm = admission(
        store, clock, key_limits=Limits(tokens_per_minute=50), quotas=Quotas(tokens_per_day=5000)
    )
    with pytest.raises(NeverAdmitted) as err:
        await adm.admit(ACME, "m", 51)
    assert "tokens_per_minute limit of key 0123456789ab (50)" in err.value.message
    adm = admission(store, clock, quotas=Quotas(tokens_per_day=40))
    with pytest.raises(NeverAdmitted) as err:
        await adm.admit(ACME, "m", 41)
    assert "tokens_per_day quota of tenant 'acme' (40)" in err.value.message
    assert "Retry-After" not in err.value.headers
    await adm.reconcile(await adm.admit(ACME, "m", 40), 40)  # the whole day fits, once


async def test_key_and_tenant_limits_both_apply(store, clock) -> None:
    adm = admission(
        store, clock, limits=Limits(requests_per_minute=5), key_limits=Limits(requests_per_minute=3)
    )
    for _ in range(3):
        await adm.admit(ACME, "m", 0)
    with pytest.raises(RateLimited) as err:
        await adm.admit(ACME, "m", 0)
    assert "key 0123456789ab" in err.value.message
    await adm.admit(ACME_KEY2, "m", 0)
    await adm.admit(ACME_KEY2, "m", 0)
    with pytest.raises(RateLimited) as err:  # the tenant's 5 are spent, across its keys
        await adm.admit(ACME_KEY2, "m", 0)
    assert "tenant acme" in err.value.message


async def test_refused_admission_takes_nothing(store, clock) -> None:
    adm = admission(store, clock, limits=Limits(requests_per_minute=10, tokens_per_minute=100))
    await adm.admit(ACME, "m", 100)
    for _ in range(20):  # refused by tokens: must not consume requests either
        with pytest.raises(RateLimited):
            await adm.admit(ACME, "m", 50)
    clock.advance(60)
    for _ in range(10):
        await adm.admit(ACME, "m", 0)


async def test_concurrency_released_on_reconcile_and_lease_expiry(store, clock) -> None:
    adm = admission(store, clock, limits=Limits(max_concurrency=2), lease_ttl_s=30)
    a = await adm.admit(ACME, "m", 0)
    await adm.admit(ACME, "m", 0)
    with pytest.raises(RateLimited) as err:
        await adm.admit(ACME, "m", 0)
    assert "max_concurrency of tenant acme" in err.value.message
    await adm.reconcile(a, 0)
    await adm.reconcile(a, 0)  # idempotent: does not free a second slot
    c = await adm.admit(ACME, "m", 0)
    with pytest.raises(RateLimited):
        await adm.admit(ACME, "m", 0)
    # The holders "crash" (never reconcile): their slots come back once the lease expires ...
    clock.advance(20)
    assert await adm.check_stream(c, 0)  # ... unless renewed, as a long stream does
    clock.advance(15)
    await adm.admit(ACME, "m", 0)  # the unrenewed slot expired
    with pytest.raises(RateLimited):  # the renewed one is still held
        await adm.admit(ACME, "m", 0)


async def test_headers_follow_openai_names(store, clock) -> None:
    adm = admission(store, clock, limits=Limits(requests_per_minute=100, tokens_per_minute=6000))
    r = await adm.admit(ACME, "m", 3000)
    assert adm.headers(r) == {
        "x-ratelimit-limit-requests": "100",
        "x-ratelimit-remaining-requests": "99",
        "x-ratelimit-reset-requests": "600ms",
        "x-ratelimit-limit-tokens": "6000",
        "x-ratelimit-remaining-tokens": "3000",
        "x-ratelimit-reset-tokens": "30s",
    }


def test_format_duration() -> None:
    assert format_duration(0) == "0s"
    assert format_duration(0.0201) == "21ms"
    assert format_duration(1.5) == "1.5s"
    assert format_duration(360) == "6m0s"
    assert format_duration(61.2) == "1m2s"


async def test_token_bucket_bound_holds_over_random_traffic(store, clock) -> None:
    """Over any interval of T s, admitted tokens <= capacity + rate * T; no refusal while it fits."""
    import random

    rng = random.Random(3)
    cap = 1000
    adm = admission(store, clock, limits=Limits(tokens_per_minute=cap))
    admitted: list[tuple[float, int]] = []
    for _ in range(400):
        clock.advance(rng.choice([0, 0, 0.05, 0.5, 2, 7]))
        cost = rng.randint(1, 300)
        try:
            r = await adm.admit(ACME, "m", cost)
        except RateLimited as err:
            assert err.retry_after_s is not None and err.retry_after_s > 0
            continue
        admitted.append((clock(), cost))
        await adm.reconcile(r, cost)  # no refunds: the plain bucket bound applies
    assert len(admitted) > 100
    for i, (start, _) in enumerate(admitted):
        total = 0
        for t, cost in admitted[i:]:
            total += cost
            assert total <= cap + cap / 60 * (t - start) + 1e-6
