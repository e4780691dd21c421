"""The SQLite store's one-statement forms against the rules in `policies/stores/_engine.py`.

A settle's bucket correction runs as one UPSERT whose SQL arithmetic must give exactly what the
memory store computes in Python; a lease count skips expired leases, which go when a request of
the same key settles.
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

from policies.stores import open_store
from policies.stores.base import BucketOp, LeaseOp


async def test_a_settles_bucket_correction_is_the_same_arithmetic_in_sqlite_and_memory(
    tmp_path: Path,
) -> None:
    path = tmp_path / "state.db"
    sqlite, memory = await open_store(f"sqlite:///{path}"), await open_store("memory://")
    rng = random.Random(5)
    keys = [f"t:acme:tokens{i}" for i in range(6)]
    now = 1_790_000_000.0
    try:
        for step in range(300):
            # the clock moves on, sometimes backwards (a replica behind): drain never refills backwards
            now += rng.choice([0.0, 0.001, 0.37, 5.0, 61.0, -2.0])
            ops = [
                BucketOp(
                    key, 1000.0, rng.choice([0.5, 16.6667, 1000 / 60]), rng.choice([-900, -7, 0, 3, 250.5])
                )
                for key in rng.sample(keys, rng.randint(1, 3))
            ]
            for store in (sqlite, memory):
                if step % 3 == 0:  # some buckets first made by an admission, as in use
                    await store.acquire(lease_id=f"a{step}", lease_ttl_s=30, buckets=ops[:1], leases=[],
                                        counters=[], now=now)  # fmt: skip
                assert await store.settle(settle_id=f"s{step}", lease_id=f"a{step}", buckets=ops, release=[],
                                          counters=[], usage=[], now=now)  # fmt: skip
        with sqlite3.connect(path) as conn:
            stored = {
                key: (level, ts) for key, level, ts in conn.execute("SELECT key, level, ts FROM buckets")
            }
        assert stored == memory.buckets  # exactly: the same floating-point operations in the same order
        assert len(stored) == len(keys)
    finally:
        await sqlite.close()
        await memory.close()


async def test_expired_leases_are_not_counted_and_go_when_their_key_settles(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = await open_store(f"sqlite:///{path}")
    lease = [LeaseOp("t:acme:concurrency", 2)]
    now = 1_790_000_000.0
    try:
        for held in ("crashed-1", "crashed-2"):  # holders that never settle
            assert (await store.acquire(lease_id=held, lease_ttl_s=10, buckets=[], leases=lease, counters=[],
                                        now=now)).ok  # fmt: skip
        assert not (await store.acquire(lease_id="x", lease_ttl_s=10, buckets=[], leases=lease, counters=[],
                                        now=now + 5)).ok  # fmt: skip
        later = now + 11  # both expired: not counted, though still stored
        assert (await store.acquire(lease_id="live", lease_ttl_s=10, buckets=[], leases=lease, counters=[],
                                    now=later)).ok  # fmt: skip
        with sqlite3.connect(path) as conn:
            assert conn.execute("SELECT count(*) FROM leases").fetchone()[0] == 3
        await store.settle(settle_id="live", lease_id="live", buckets=[], release=[lease[0].key], counters=[],
                           usage=[], now=later)  # fmt: skip
        with sqlite3.connect(path) as conn:
            assert (
                conn.execute("SELECT count(*) FROM leases").fetchone()[0] == 0
            )  # the key's expired ones too
    finally:
        await store.close()
