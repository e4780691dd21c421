"""The Redis store's pipeline sender on its own connection (`RedisStore._round_trip`), against a real
redis-server: a connection the server dropped is replaced without failing the request, a server
that does not answer in time fails closed (503) and the next request finds it again."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from policies.errors import StoreUnavailable
from policies.stores import open_store
from policies.types import Limits
from tests.policies.helpers import ACME, admission


async def _store(redis_url: str):  # noqa: ANN202
    return await open_store(f"{redis_url}?prefix=t{uuid.uuid4().hex[:12]}:")


async def test_a_connection_the_server_dropped_is_replaced_without_failing_a_request(
    redis_url, clock
) -> None:  # noqa: ANN001
    store = await _store(redis_url)
    try:
        gate = admission(store, clock, limits=Limits(requests_per_minute=10))
        await gate.reconcile(await gate.admit(ACME, "m", 1), 1)
        killed = await store._client.client_kill_filter(_type="normal", skipme=True)
        assert killed >= 1  # the sender's own connection among them
        await gate.reconcile(await gate.admit(ACME, "m", 1), 1)  # no StoreUnavailable
        rows = await store.usage("acme")
        assert sum(r.requests for r in rows if len(r.period) == 10) == 2
        assert store.pipelines >= 4
    finally:
        await store.close()


async def test_a_server_that_does_not_answer_in_time_fails_closed_then_is_found_again(
    redis_url, clock
) -> None:  # noqa: ANN001
    store = await _store(redis_url)
    store._timeout_s = 0.2
    other = await _store(redis_url)
    try:
        gate = admission(store, clock, limits=Limits(requests_per_minute=10))
        await gate.reconcile(await gate.admit(ACME, "m", 1), 1)
        await other._client.execute_command("CLIENT", "PAUSE", "600", "ALL")
        with pytest.raises(StoreUnavailable) as err:
            await gate.admit(ACME, "m", 1)
        assert err.value.status == 503 and "TimeoutError" in err.value.detail
        await asyncio.sleep(0.6)  # the pause ends
        await gate.reconcile(await gate.admit(ACME, "m", 1), 1)
    finally:
        await other._client.execute_command("CLIENT", "UNPAUSE")
        await other.close()
        await store.close()
