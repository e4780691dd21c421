"""What a dead process left reserved comes back within seconds, on every store; a live one's never does."""

from __future__ import annotations

import pytest

from policies.errors import QuotaExceeded, RateLimited
from policies.types import Limits, Quotas
from tests.policies.helpers import ACME, admission

TTL_S = 8.0


async def test_a_dead_processes_leases_and_reservations_are_released(replicas, clock) -> None:
    limits, quotas = Limits(max_concurrency=3), Quotas(tokens_per_day=3000)
    dead = admission(await replicas(), clock, limits=limits, quotas=quotas, instance="dead")
    alive = admission(await replicas(), clock, limits=limits, quotas=quotas, instance="alive")
    await dead.heartbeat(TTL_S)
    await alive.heartbeat(TTL_S)
    held = [await dead.admit(ACME, "m", 1000) for _ in range(3)]  # then it is killed: never settled
    with pytest.raises((RateLimited, QuotaExceeded)):
        await alive.admit(ACME, "m", 1)
    assert await alive.recover() == 0  # its heartbeat has not lapsed yet: nothing is taken from it
    clock.advance(TTL_S + 1)
    await alive.heartbeat(TTL_S)
    assert await alive.recover() == 3
    assert await alive.recover() == 0  # once
    again = [await alive.admit(ACME, "m", 1000) for _ in range(3)]  # slots and quota are back
    for r in again:
        await alive.reconcile(r, 10)
    # the "dead" process was only stalled: its late settle records the request that did run, charged
    # once at its real cost (the reclaim had refunded the whole reservation)
    await dead.reconcile(held[0], 10)
    await dead.reconcile(held[0], 10)  # still once
    rows = [u for u in await alive.usage("acme") if len(u.period) == 10]
    assert [(u.requests, u.tokens) for u in rows] == [(4, 40)]
    quota_left = 3000 - 4 * 10  # three settled at 10 tokens, and the late one's 10
    with pytest.raises(QuotaExceeded):
        await alive.admit(ACME, "m", quota_left + 1)
    await alive.reconcile(await alive.admit(ACME, "m", quota_left), 0)


async def test_a_live_process_keeps_its_reservations(replicas, clock) -> None:
    one = admission(await replicas(), clock, limits=Limits(max_concurrency=1), instance="one")
    other = admission(await replicas(), clock, limits=Limits(max_concurrency=1), instance="other")
    await one.heartbeat(TTL_S)
    reservation = await one.admit(ACME, "m", 1)
    for _ in range(5):  # minutes pass, the stream goes on, the heartbeat is renewed
        clock.advance(TTL_S - 1)
        await one.heartbeat(TTL_S)
        await other.heartbeat(TTL_S)
        assert await other.recover() == 0
    with pytest.raises(RateLimited):
        await other.admit(ACME, "m", 1)
    await one.reconcile(reservation, 1)
    await other.reconcile(await other.admit(ACME, "m", 1), 1)
