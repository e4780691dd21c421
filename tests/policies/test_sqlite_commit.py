"""Where SQLite groups commit: on the event loop while the write lock is free, else on the store's thread."""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import pytest

from policies.errors import RateLimited
from policies.stores import UsageDelta, open_store
from policies.stores.base import BucketOp
from policies.types import Limits, Quotas
from tests.policies.helpers import ACME, admission


@pytest.fixture(autouse=True)
def _patient_loop(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A slow CI machine must not look like a busy loop (the busy rule has a test of its own)."""
    monkeypatch.setattr("policies.stores.sqlite.group_commit._LOOP_BUSY_S", 10.0)


def _spy_threads(store) -> set[str]:  # type: ignore[no-untyped-def]
    """Record the name of every thread a group runs on."""
    seen: set[str] = set()
    run_group = store._run_group

    def spying(conn, group):  # type: ignore[no-untyped-def]
        seen.add(threading.current_thread().name)
        return run_group(conn, group)

    store._run_group = spying
    return seen


async def test_groups_commit_on_the_loop_when_the_lock_is_free(tmp_path, clock) -> None:
    store = await open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        threads = _spy_threads(store)
        gate = admission(store, clock, limits=Limits(requests_per_minute=3), quotas=Quotas(tokens_per_day=100))
        for _ in range(3):
            await gate.reconcile(await gate.admit(ACME, "m", 10), 10)
        with pytest.raises(RateLimited):
            await gate.admit(ACME, "m", 10)
        assert threads == {threading.current_thread().name}
        assert store.loop_groups == store.groups >= 6
        rows = await store.usage("acme")
        assert sum(r.tokens for r in rows if len(r.period) == 10) == 30
    finally:
        await store.close()


async def test_a_busy_loop_hands_even_a_single_operation_to_the_thread(tmp_path, clock, monkeypatch) -> None:
    monkeypatch.setattr("policies.stores.sqlite.group_commit._LOOP_BUSY_S", 0.0)  # any wait counts as busy
    store = await open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        threads = _spy_threads(store)
        gate = admission(store, clock, quotas=Quotas(tokens_per_day=100))
        await gate.reconcile(await gate.admit(ACME, "m", 10), 10)
        assert (store.groups, store.loop_groups) == (2, 0)
        assert threading.current_thread().name not in threads
    finally:
        await store.close()


async def test_overlapping_operations_commit_together_on_the_thread(tmp_path, clock) -> None:
    store = await open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        threads = _spy_threads(store)
        gate = admission(store, clock, limits=Limits(requests_per_minute=5))
        admitted = await asyncio.gather(*(gate.admit(ACME, "m", 1) for _ in range(8)), return_exceptions=True)
        assert sum(not isinstance(a, RateLimited) for a in admitted) == 5  # exact in one group
        assert (store.groups, store.grouped_ops, store.loop_groups) == (1, 8, 0)
        assert threading.current_thread().name not in threads
    finally:
        await store.close()


async def test_a_group_waits_on_the_thread_while_another_process_holds_the_lock(tmp_path, clock) -> None:
    path = tmp_path / "state.db"
    store = await open_store(f"sqlite:///{path}")
    other = sqlite3.connect(path, isolation_level=None)  # stands for a second gateway process
    try:
        threads = _spy_threads(store)
        gate = admission(store, clock, quotas=Quotas(tokens_per_day=100))
        other.execute("BEGIN IMMEDIATE")  # holds the write lock
        admit = asyncio.create_task(gate.admit(ACME, "m", 10))
        ticks = 0
        for _ in range(20):  # the loop keeps running while the group waits for the lock
            await asyncio.sleep(0.01)
            ticks += 1
        assert not admit.done() and ticks == 20
        other.execute("COMMIT")
        reservation = await asyncio.wait_for(admit, 5)
        assert store.loop_groups == 0 and len(threads) == 1
        assert threads != {threading.current_thread().name}  # it ran on the store's thread
        # The thread answers the group before it looks for more work: until it has, a new operation
        # would still join its drain, so wait for it to finish (CI once saw the reconcile ride along).
        for _ in range(500):
            if not store._draining:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("the store's thread was still draining after 5 s")
        await gate.reconcile(reservation, 10)  # the lock is free again: back on the loop
        assert store.loop_groups == 1
        assert [r.tokens for r in await store.usage("acme") if len(r.period) == 10] == [10]
    finally:
        other.close()
        await store.close()


def _acquire_a_token(store, lease_id: str, now: float):  # type: ignore[no-untyped-def]
    return store.acquire(lease_id=lease_id, lease_ttl_s=30.0, buckets=[BucketOp("t:acme:rpm", 10.0, 1.0, 1.0)],
                         leases=[], counters=[], now=now, urgent=True)  # fmt: skip


async def test_an_urgent_operation_commits_in_its_callers_own_step(tmp_path, clock, monkeypatch) -> None:
    """The lease path's calls (their caller holds the top-up lock): no wait for a group, even on a
    loop so busy that any other operation goes to the thread."""
    monkeypatch.setattr("policies.stores.sqlite.group_commit._LOOP_BUSY_S", 0.0)
    store = await open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        threads = _spy_threads(store)
        call = _acquire_a_token(store, "slice-1", clock())
        with pytest.raises(StopIteration) as answered:  # done at its first step: it never suspended
            call.send(None)
        assert answered.value.value.ok
        settles = [dict(settle_id=f"s{i}", lease_id="slice-1", buckets=[], release=[], counters=[],
                        usage=[UsageDelta("acme", "m", "2026-11", 1, 1)], now=clock()) for i in range(3)]  # fmt: skip
        batch = store.settle_many(settles, urgent=True)
        with pytest.raises(StopIteration) as answered:
            batch.send(None)
        assert answered.value.value == [True, True, True]
        assert threads == {threading.current_thread().name}
        assert (store.groups, store.loop_groups) == (2, 2)  # the three settles in one transaction
        await store._tx(_write("later"))  # not urgent: this busy loop sends it to the thread
        assert store.loop_groups == 2 and len(threads) == 2
    finally:
        await store.close()


async def test_an_urgent_backlog_of_settles_goes_to_the_thread(tmp_path, clock, monkeypatch) -> None:
    """After an outage a tick may carry many batches: committed on the loop they would stall it."""
    monkeypatch.setattr("policies.stores.sqlite.store._URGENT_SETTLES_AT_MOST", 4)
    store = await open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        threads = _spy_threads(store)
        settles = [dict(settle_id=f"s{i}", lease_id="x", buckets=[], release=[], counters=[],
                        usage=[UsageDelta("acme", "m", "2026-11", 1, 1)], now=clock()) for i in range(5)]  # fmt: skip
        assert await store.settle_many(settles, urgent=True) == [True] * 5
        assert store.loop_groups == 0 and threading.current_thread().name not in threads
        for _ in range(500):  # the thread answers before it stops draining; until then, urgent calls queue
            if not store._draining:
                break
            await asyncio.sleep(0.01)
        assert await store.settle_many(settles[:4], urgent=True) == [False] * 4  # on the loop, applied once
        assert store.loop_groups == 1
    finally:
        await store.close()


async def test_an_urgent_operation_keeps_its_place_behind_a_queued_group(tmp_path, clock) -> None:
    store = await open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        first = asyncio.create_task(store._tx(_write("first")))
        await asyncio.sleep(0)  # queued, its drain scheduled
        assert (await _acquire_a_token(store, "slice-1", clock())).ok
        await first
        assert (store.groups, store.grouped_ops) == (1, 2)  # it joined the queued group
    finally:
        await store.close()


async def test_an_urgent_operation_waits_on_the_thread_while_another_process_holds_the_lock(
    tmp_path, clock
) -> None:
    path = tmp_path / "state.db"
    store = await open_store(f"sqlite:///{path}")
    other = sqlite3.connect(path, isolation_level=None)  # stands for a second gateway process
    try:
        threads = _spy_threads(store)
        other.execute("BEGIN IMMEDIATE")
        call = asyncio.create_task(_acquire_a_token(store, "slice-1", clock()))
        await asyncio.sleep(0.05)  # the loop runs on while it waits
        assert not call.done()
        other.execute("COMMIT")
        assert (await asyncio.wait_for(call, 5)).ok
        assert store.loop_groups == 0 and threading.current_thread().name not in threads
    finally:
        other.close()
        await store.close()


@pytest.mark.parametrize("query", ["?synchronous=full", "?commit=thread"])
async def test_fsync_per_commit_or_asked_for_keeps_groups_on_the_thread(tmp_path, clock, query) -> None:
    store = await open_store(f"sqlite:///{tmp_path / 'state.db'}{query}")
    try:
        threads = _spy_threads(store)
        gate = admission(store, clock, quotas=Quotas(tokens_per_day=100))
        await gate.reconcile(await gate.admit(ACME, "m", 10), 10)
        assert store.loop_groups == 0 and store.groups == 2
        assert threading.current_thread().name not in threads
    finally:
        await store.close()


async def test_an_unknown_commit_option_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="commit must be loop or thread"):
        await open_store(f"sqlite:///{tmp_path / 'state.db'}?commit=sometimes")


async def test_close_answers_a_group_scheduled_on_the_loop(tmp_path, clock) -> None:
    store = await open_store(f"sqlite:///{tmp_path / 'state.db'}")
    gate = admission(store, clock, quotas=Quotas(tokens_per_day=100))
    admit = asyncio.create_task(gate.admit(ACME, "m", 10))
    await asyncio.sleep(0)  # queued, its drain scheduled on the loop
    await store.close()
    assert (await admit).id  # answered before the connection closed


async def test_the_wal_is_checkpointed_from_the_thread(tmp_path, clock, monkeypatch) -> None:
    monkeypatch.setattr("policies.stores.sqlite.group_commit._CHECKPOINT_EVERY", 4)
    path = tmp_path / "state.db"
    store = await open_store(f"sqlite:///{path}")
    try:
        checkpoints: list[str] = []
        checkpoint = store._checkpoint
        store._checkpoint = lambda: (checkpoints.append(threading.current_thread().name), checkpoint())
        gate = admission(store, clock, quotas=Quotas(tokens_per_day=10_000))
        for _ in range(6):
            await gate.reconcile(await gate.admit(ACME, "m", 1), 1)
        await asyncio.sleep(0.1)
        assert len(checkpoints) == 3 and threading.current_thread().name not in checkpoints
    finally:
        await store.close()


def _write_then_fail(conn: sqlite3.Connection) -> None:
    conn.execute("INSERT INTO marks VALUES ('k', 'failed', 'x')")
    raise ValueError("this operation fails after writing")


def _write(field: str):  # type: ignore[no-untyped-def]
    return lambda conn: conn.execute("INSERT INTO marks VALUES ('k', ?, 'x')", (field,))


@pytest.mark.parametrize("companions", [0, 2])
async def test_a_failing_operation_undoes_only_its_own_writes(tmp_path, companions) -> None:
    """Alone in its group (no savepoint) or among others (its savepoint): the others commit."""
    store = await open_store(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        calls = [store._tx(_write_then_fail)] + [store._tx(_write(f"ok{i}")) for i in range(companions)]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert isinstance(outcomes[0], ValueError)
        assert not any(isinstance(o, BaseException) for o in outcomes[1:])
        # one transaction for all; a failing operation alone in it commits nothing
        assert (store.groups, store.grouped_ops) == ((1, 1 + companions) if companions else (0, 0))
        assert await store.get_marks("k") == {f"ok{i}": "x" for i in range(companions)}
    finally:
        await store.close()


_OLD_SCHEMA = """
CREATE TABLE buckets (key TEXT PRIMARY KEY, level REAL NOT NULL, ts REAL NOT NULL);
CREATE TABLE leases (key TEXT NOT NULL, lease_id TEXT NOT NULL, expires_at REAL NOT NULL, PRIMARY KEY (key, lease_id));
CREATE TABLE counters (key TEXT PRIMARY KEY, used INTEGER NOT NULL, expires_at REAL NOT NULL);
CREATE TABLE usage (tenant TEXT NOT NULL, model TEXT NOT NULL, period TEXT NOT NULL,
    requests INTEGER NOT NULL, tokens INTEGER NOT NULL, PRIMARY KEY (tenant, model, period));
CREATE TABLE settled (id TEXT PRIMARY KEY, at REAL NOT NULL);
CREATE TABLE journal (id TEXT PRIMARY KEY, instance TEXT NOT NULL, payload TEXT NOT NULL);
"""


async def test_a_file_with_the_older_rowid_tables_serves_as_before(tmp_path, clock) -> None:
    path = tmp_path / "state.db"
    with sqlite3.connect(path) as old:
        old.executescript(_OLD_SCHEMA)
        old.execute("INSERT INTO usage VALUES ('acme', 'm', '2026-11-21', 1, 5)")
    store = await open_store(f"sqlite:///{path}")
    try:
        gate = admission(store, clock, limits=Limits(max_concurrency=1), quotas=Quotas(tokens_per_day=20))
        reservation = await gate.admit(ACME, "m", 10)
        with pytest.raises(RateLimited):  # the concurrency slot is taken
            await gate.admit(ACME, "m", 1)
        await gate.reconcile(reservation, 10)
        assert [r.tokens for r in await store.usage("acme") if len(r.period) == 10] == [15]
        with sqlite3.connect(path) as check:
            (sql,) = check.execute("SELECT sql FROM sqlite_master WHERE name = 'buckets'").fetchone()
        assert "WITHOUT ROWID" not in sql  # the file kept its tables
    finally:
        await store.close()
