"""Limits across replicas (two store instances on one state) and behaviour when the store is down."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from policies.errors import QuotaExceeded, RateLimited, StoreUnavailable
from policies.stores import open_store
from policies.stores.redis import RedisStore
from policies.types import Limits, Quotas
from tests.policies.helpers import ACME, ACME_KEY2, admission
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]


async def _burst(adms, n: int, cost=lambda i: 0) -> tuple[list, int]:  # noqa: ANN001
    async def one(i: int):  # noqa: ANN202
        try:
            return await adms[i % len(adms)].admit(ACME if i % 3 else ACME_KEY2, "m", cost(i))
        except (RateLimited, QuotaExceeded):
            return None

    results = await asyncio.gather(*(one(i) for i in range(n)))
    admitted = [r for r in results if r is not None]
    return admitted, n - len(admitted)


async def test_request_limit_does_not_multiply_by_replicas(replicas, clock) -> None:
    limits = Limits(requests_per_minute=100)
    adms = [admission(await replicas(), clock, limits=limits) for _ in range(2)]
    admitted, refused = await _burst(adms, 500)
    assert len(admitted) == 100 and refused == 400


async def test_token_limit_and_quota_hold_across_replicas(replicas, clock) -> None:
    rng = random.Random(7)
    costs = [rng.randint(1, 400) for _ in range(300)]
    limits, quotas = Limits(tokens_per_minute=20_000), Quotas(tokens_per_day=15_000)
    adms = [admission(await replicas(), clock, limits=limits, quotas=quotas) for _ in range(2)]
    admitted, _ = await _burst(adms, 300, cost=lambda i: costs[i])
    total = sum(r.cost_tokens for r in admitted)
    assert total <= 15_000
    assert total > 15_000 - 400  # and the budget is really used, not refused wholesale
    rows = []
    for r in admitted:  # reconcile on the other replica than the one that admitted: same state
        await adms[1].reconcile(r, r.cost_tokens // 2)
    rows = await adms[0].usage("acme")
    assert {row.period: row.tokens for row in rows}["2026-11-21"] == sum(r.cost_tokens // 2 for r in admitted)


async def test_concurrency_limit_holds_across_replicas(replicas, clock) -> None:
    adms = [admission(await replicas(), clock, limits=Limits(max_concurrency=7)) for _ in range(2)]
    admitted, refused = await _burst(adms, 60)
    assert len(admitted) == 7
    await asyncio.gather(*(adms[0].reconcile(r, 0) for r in admitted))
    admitted, _ = await _burst(adms, 60)
    assert len(admitted) == 7


async def test_unreachable_redis_is_store_unavailable(clock) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StoreUnavailable) as err:
        await open_store(url)
    assert err.value.status == 503 and err.value.code == "state_store_unavailable"
    import redis.asyncio as aioredis

    client = aioredis.from_url(url, decode_responses=True, socket_connect_timeout=0.5)
    store = RedisStore(client, url)  # a store whose server went away after start
    try:
        adm = admission(store, clock, limits=Limits(requests_per_minute=5))
        with pytest.raises(StoreUnavailable):
            await adm.admit(ACME, "m", 1)
        assert adm.stats["store_unavailable"] == 1
    finally:
        await store.close()


async def test_closed_sqlite_store_is_unavailable(tmp_path, clock) -> None:
    store = await open_store(f"sqlite:///{tmp_path / 's.db'}")
    await store.close()
    await store.close()
    with pytest.raises(StoreUnavailable):
        await admission(store, clock, limits=Limits(max_concurrency=1)).admit(ACME, "m", 1)


async def test_fail_open_is_bounded_in_time_and_amount(tmp_path, clock) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    import redis.asyncio as aioredis

    store = RedisStore(aioredis.from_url(url, socket_connect_timeout=0.5), url)
    try:
        adm = admission(store, clock, limits=Limits(requests_per_minute=3), fail_open_s=10)
        admitted = [await adm.admit(ACME, "m", 0) for _ in range(3)]  # local limits still apply
        assert all(r.degraded for r in admitted)
        with pytest.raises(RateLimited):
            await adm.admit(ACME, "m", 0)
        await adm.reconcile(admitted[0], 0)  # kept for the store's return
        assert adm.stats["reconcile_deferred"] == 1
        clock.advance(11)  # past the window: fail closed
        with pytest.raises(StoreUnavailable):
            await adm.admit(ACME, "m", 0)
        assert adm.stats["fail_open"] == 3
    finally:
        await store.close()


async def test_deferred_reconcile_reaches_the_store_when_it_is_back(tmp_path, clock) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    store = await open_store(url)
    adm = admission(store, clock)
    r = await adm.admit(ACME, "m", 10)
    await store.close()  # the store goes away mid-request
    await adm.reconcile(r, 8)
    assert adm.stats["reconcile_deferred"] == 1
    adm._store = await open_store(url)  # ... and comes back (a new connection)
    await adm.reconcile(await adm.admit(ACME, "m", 1), 1)  # the next settle that works flushes it
    assert [(u.period, u.tokens) for u in await adm.usage()] == [("2026-11", 9), ("2026-11-21", 9)]
    await adm._store.close()


_CHILD = textwrap.dedent(
    """
    import asyncio, os, sys, time
    from policies.admission import Admission
    from policies.errors import RateLimited
    from policies.principal import Principal
    from policies.stores import open_store
    from policies.types import Limits, TenantSpec

    async def main() -> None:
        url, go, now = sys.argv[1], sys.argv[2], float(sys.argv[3])
        store = await open_store(url)
        spec = TenantSpec(limits=Limits(requests_per_minute=100))
        adm = Admission(store, {"acme": spec}, lambda: now)  # one instant: no refill during the burst
        who = Principal("acme", "0123456789ab", ("*",))
        print("ready", flush=True)
        while not os.path.exists(go):
            time.sleep(0.005)

        async def one() -> int:
            try:
                await adm.admit(who, "m", 1)
                return 1
            except RateLimited:
                return 0

        print(sum(await asyncio.gather(*(one() for _ in range(250)))), flush=True)
        await store.close()

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
async def test_two_processes_burst_500_against_100_per_minute(kind, request, tmp_path, clock) -> None:
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'state.db'}"
    else:
        url = f"{request.getfixturevalue('redis_url')}?prefix=p{uuid.uuid4().hex[:8]}:"
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, url, str(go), repr(clock())],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for child in children:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        go.touch()
        admitted = [int(child.stdout.readline()) for child in children]  # type: ignore[union-attr]
    finally:
        for child in children:
            child.wait(timeout=30)
    assert sum(admitted) == 100, admitted
