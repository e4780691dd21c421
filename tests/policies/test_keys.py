"""API keys on every store: create/list/revoke/expire/authenticate, and revocation across replicas."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from policies.errors import Unauthenticated
from policies.keys import KeyService, parse_key
from policies.principal import Principal


async def test_create_authenticate_list(store, clock) -> None:
    keys = KeyService(store, clock, tenants={"acme", "beta"})
    record, secret = await keys.create("acme", models=["llama*"], name="ci")
    assert parse_key(secret) == (record.key_id, secret.split("-", 2)[2])
    assert len(secret.split("-", 2)[2]) == 43  # 256 random bits
    principal = await keys.authenticate(secret)
    assert principal == Principal("acme", record.key_id, ("llama*",))
    await keys.create("beta")
    listed = await keys.list("acme")
    assert [r.key_id for r in listed] == [record.key_id]
    assert listed[0].name == "ci" and listed[0].models == ["llama*"] and listed[0].revoked_at is None
    assert listed[0].created_at == datetime.fromtimestamp(clock(), UTC)
    dumped = msgspec.json.encode(await keys.list()).decode()
    assert secret.split("-", 2)[2] not in dumped and "hash" not in dumped  # no secret, no hash
    assert len(await keys.list()) == 2
    with pytest.raises(ValueError, match="unknown tenant 'nope'"):
        await keys.create("nope")


@pytest.mark.parametrize(
    "presented",
    [None, "", "sk-whatever", "fg-0123456789ab-short", "fg-XYZ-" + "a" * 43, "fg-0123456789ab-" + "a" * 43],
)
async def test_bad_keys_are_refused_without_echo(store, clock, presented) -> None:
    keys = KeyService(store, clock)
    await keys.create("acme")
    with pytest.raises(Unauthenticated) as err:
        await keys.authenticate(presented)
    assert err.value.status == 401 and err.value.code == "invalid_api_key"
    if presented:
        assert presented not in err.value.message and "a" * 10 not in err.value.message


async def test_wrong_secret_for_a_real_id(store, clock) -> None:
    keys = KeyService(store, clock)
    record, secret = await keys.create("acme")
    forged = f"fg-{record.key_id}-" + "A" * 43
    with pytest.raises(Unauthenticated, match="invalid API key"):
        await keys.authenticate(forged)
    assert (await keys.authenticate(secret)).key_id == record.key_id


async def test_expired_and_revoked_keys(store, clock) -> None:
    keys = KeyService(store, clock, cache_ttl_s=0)
    expires = datetime.fromtimestamp(clock(), UTC) + timedelta(hours=1)
    record, secret = await keys.create("acme", expires_at=expires)
    await keys.authenticate(secret)
    clock.advance(3600)
    with pytest.raises(Unauthenticated, match="expired"):
        await keys.authenticate(secret)
    with pytest.raises(ValueError, match="not in the future"):
        await keys.create("acme", expires_at=expires - timedelta(hours=2))
    other, other_secret = await keys.create("acme")
    assert await keys.revoke(other.key_id) is True
    assert await keys.revoke(other.key_id) is True  # still exists, still revoked
    assert await keys.revoke("ffffffffffff") is False
    with pytest.raises(Unauthenticated, match="revoked"):
        await keys.authenticate(other_secret)
    (listed,) = [r for r in await keys.list() if r.key_id == other.key_id]
    assert listed.revoked_at == datetime.fromtimestamp(clock(), UTC)


async def test_revocation_reaches_another_replica_within_a_second(replicas, clock) -> None:
    one = KeyService(await replicas(), clock)
    two = KeyService(await replicas(), clock)  # another gateway process, its own cache
    record, secret = await one.create("acme")
    await two.authenticate(secret)  # now cached on replica two
    await one.revoke(record.key_id)
    clock.advance(0.6)
    with pytest.raises(Unauthenticated, match="revoked"):
        await two.authenticate(secret)


async def test_revocation_with_the_real_clock(replicas) -> None:
    one = KeyService(await replicas(), time.time)
    two = KeyService(await replicas(), time.time)
    record, secret = await one.create("acme")
    await two.authenticate(secret)
    await one.revoke(record.key_id)
    revoked_at = time.monotonic()
    while True:
        try:
            await two.authenticate(secret)
        except Unauthenticated:
            break
        await asyncio.sleep(0.02)
    assert time.monotonic() - revoked_at < 1.0


async def test_tenant_removed_from_config_stops_its_keys(store, clock) -> None:
    keys = KeyService(store, clock, tenants={"acme"})
    _, secret = await keys.create("acme")
    keys.update_tenants({"beta"})
    with pytest.raises(Unauthenticated, match="no longer configured"):
        await keys.authenticate(secret)


def test_cache_ttl_cannot_exceed_one_second(clock) -> None:
    with pytest.raises(ValueError):
        KeyService(None, clock, cache_ttl_s=2)  # type: ignore[arg-type]


def test_principal_can_see_needs_both_globs() -> None:
    p = Principal("acme", "0123456789ab", ("llama*", "digits"))
    assert p.can_see("llama-cpu", ["*"])
    assert not p.can_see("llama-cpu", ["digits*"])
    assert p.can_see("digits", ["digits*"])
    assert not p.can_see("other", ["*"])
    assert not Principal("acme", "x", ("*",)).can_see("Digits", ["digits"])  # case-sensitive


async def test_store_down_fails_closed_unless_stale_allowed(tmp_path, clock) -> None:
    from policies.errors import StoreUnavailable
    from policies.stores import open_store

    store = await open_store(f"sqlite:///{tmp_path / 'k.db'}")
    strict = KeyService(store, clock)
    lenient = KeyService(store, clock, stale_if_error_s=30)
    _, secret = await strict.create("acme")
    await strict.authenticate(secret)
    await lenient.authenticate(secret)
    await store.close()  # the store goes away
    clock.advance(1)
    with pytest.raises(StoreUnavailable):
        await strict.authenticate(secret)
    assert (await lenient.authenticate(secret)).tenant == "acme"
    clock.advance(30)
    with pytest.raises(StoreUnavailable):
        await lenient.authenticate(secret)


class CountingStore:
    """The real store, counting key lookups (a spy: the answers are the store's own)."""

    def __init__(self, store) -> None:  # type: ignore[no-untyped-def]
        self._store = store
        self.lookups = 0

    async def get_key(self, key_id: str):  # type: ignore[no-untyped-def]
        self.lookups += 1
        await asyncio.sleep(0.01)  # a store round trip, so concurrent lookups overlap
        return await self._store.get_key(key_id)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._store, name)


async def test_unknown_and_concurrent_lookups_reach_the_store_once(store, clock) -> None:
    counting = CountingStore(store)
    keys = KeyService(counting, clock)  # type: ignore[arg-type]
    unknown = "fg-0123456789ab-" + "A" * 43
    for _ in range(20):
        with pytest.raises(Unauthenticated):
            await keys.authenticate(unknown)
    assert counting.lookups == 1  # a repeated wrong key is answered from the negative cache
    _, secret = await keys.create("acme")
    before = counting.lookups
    principals = await asyncio.gather(*(keys.authenticate(secret) for _ in range(16)))
    assert {p.tenant for p in principals} == {"acme"} and counting.lookups == before + 1


async def test_last_use_is_recorded_at_most_once_a_minute_per_replica(store, clock) -> None:
    keys = KeyService(store, clock, tenants={"acme"}, cache_ttl_s=0)
    record, secret = await keys.create("acme")
    assert (await keys.list())[0].last_used_at is None
    await keys.authenticate(secret)
    await keys.uses_written()
    first = datetime.fromtimestamp(clock(), UTC)
    assert (await keys.list())[0].last_used_at == first
    clock.advance(30)
    await keys.authenticate(secret)  # within the minute: not written again
    await keys.uses_written()
    assert (await keys.list())[0].last_used_at == first
    clock.advance(31)
    await keys.authenticate(secret)
    await keys.uses_written()
    assert (await keys.list())[0].last_used_at == datetime.fromtimestamp(clock(), UTC)
    # an older time never replaces a newer one (another replica's late write)
    await store.touch_key(record.key_id, clock() - 120)
    await store.touch_key("ffffffffffff", clock())  # no such key: nothing happens
    assert (await keys.list())[0].last_used_at == datetime.fromtimestamp(clock(), UTC)
    assert (await store.get_key(record.key_id))[0].last_used_at is not None


def test_sqlite_file_of_an_older_release_gains_the_last_used_column(tmp_path) -> None:
    import sqlite3

    from policies.stores import open_store

    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE keys (key_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, hash TEXT NOT NULL, models TEXT NOT NULL,"
        " name TEXT, created_at REAL NOT NULL, expires_at REAL, revoked_at REAL)"
    )
    conn.execute("INSERT INTO keys VALUES ('0123456789ab', 'acme', 'h', '[\"*\"]', NULL, 1.0, NULL, NULL)")
    conn.commit()
    conn.close()

    async def run() -> None:
        store = await open_store(f"sqlite:///{path}")
        try:
            await store.touch_key("0123456789ab", 5.0)
            [record] = await store.list_keys()
            assert record.key_id == "0123456789ab" and record.last_used_at == datetime.fromtimestamp(5.0, UTC)
        finally:
            await store.close()

    asyncio.run(run())
