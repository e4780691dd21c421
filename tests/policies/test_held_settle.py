"""Background (batch) requests on every store: no per-minute limits, quotas kept, and a settlement
that lands only with the line's mark, once, even after a reclaim refunded its reservation."""

from __future__ import annotations

import msgspec
import pytest

from policies.errors import QuotaExceeded, RateLimited
from policies.held_settle import HeldSettle
from policies.stores.base import Mark
from policies.types import Limits, Quotas
from tests.policies.helpers import ACME, admission


def background() -> tuple[HeldSettle, object]:
    held = HeldSettle()
    return held, msgspec.structs.replace(ACME, background=held)


async def test_background_requests_skip_rate_limits_but_not_quotas(store, clock) -> None:
    adm = admission(
        store,
        clock,
        limits=Limits(requests_per_minute=1, max_concurrency=1),
        quotas=Quotas(tokens_per_day=100),
    )
    for _ in range(3):  # three at once, past both the per-minute and the concurrency limit
        held, principal = background()
        await adm.admit(principal, "m", 30)
    await adm.reconcile(await adm.admit(ACME, "m", 5), 5)  # the interactive budget is untouched
    with pytest.raises(RateLimited):
        await adm.admit(ACME, "m", 1)
    with pytest.raises(QuotaExceeded):  # 90 reserved + 5 used: 10 more do not fit
        await adm.admit(background()[1], "m", 10)


async def test_a_held_settlement_lands_with_its_marks_once(store, clock) -> None:
    adm = admission(store, clock, quotas=Quotas(tokens_per_day=1000))
    held, principal = background()
    await adm.reconcile(await adm.admit(principal, "m", 50), 20)
    assert await store.usage("acme") == []  # nothing on the bill before the commit
    mark = Mark("lines:b", "0", "a:200")
    await adm.commit(held, [mark])
    await adm.commit(held, [mark])  # a commit retried (its first answer lost) changes nothing
    assert await store.get_marks("lines:b") == {"0": "a:200"}
    assert [(u.requests, u.tokens) for u in await store.usage("acme") if len(u.period) == 10] == [(1, 20)]
    with pytest.raises(QuotaExceeded):  # 20 used (the other 30 reserved were refunded)
        await adm.admit(ACME, "m", 981)
    never, _ = background()  # never admitted (refused before admission): only the marks
    await adm.commit(never, [Mark("lines:b", "1", "x:404")])
    assert (await store.get_marks("lines:b"))["1"] == "x:404"


async def test_a_reclaimed_reservation_is_charged_late_with_its_marks(replicas, clock) -> None:
    quotas = Quotas(tokens_per_day=1000)
    slow = admission(await replicas(), clock, quotas=quotas, instance="slow")
    other = admission(await replicas(), clock, quotas=quotas, instance="other")
    await other.heartbeat(5.0)
    held, principal = background()
    reservation = await slow.admit(principal, "m", 100)
    clock.advance(10.0)
    await other.heartbeat(5.0)
    assert await other.recover() == 1  # `slow` looked dead: its reservation was refunded
    await slow.reconcile(reservation, 40)
    await slow.commit(held, [Mark("lines:c", "0", "a:200")])
    store = await replicas()
    assert await store.get_marks("lines:c") == {"0": "a:200"}
    assert [(u.requests, u.tokens) for u in await store.usage("acme") if len(u.period) == 10] == [(1, 40)]
    with pytest.raises(QuotaExceeded):
        await other.admit(ACME, "m", 961)


async def test_a_line_settled_by_another_attempt_is_never_billed_twice(store, clock) -> None:
    """Two runners that both ran a line (one lost its claim without knowing): the first commit
    bills it, the second, whose mark names another attempt, applies nothing, also not late."""
    adm = admission(store, clock, quotas=Quotas(tokens_per_day=1000))
    first, principal = background()
    await adm.reconcile(await adm.admit(principal, "m", 50), 20)
    second, principal2 = background()
    await adm.reconcile(await adm.admit(principal2, "m", 50), 20)
    await adm.commit(first, [Mark("lines:b", "0", "first:200")])
    await adm.commit(second, [Mark("lines:b", "0", "second:200")])
    assert await store.get_marks("lines:b") == {"0": "first:200"}
    assert [(u.requests, u.tokens) for u in await store.usage("acme") if len(u.period) == 10] == [(1, 20)]
