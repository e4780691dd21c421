"""The audit log on every store (memory, SQLite, Redis): appended entries read back newest first,
filtered, paged without overlap, secrets redacted, shared by replicas, never rewritten."""

from __future__ import annotations

import pytest

from policies.audit import AuditLog, parse_when
from policies.stores import StateStore
from tests.policies.conftest import FakeClock


async def test_entries_read_back_filtered_and_paged(store: StateStore, clock: FakeClock) -> None:
    trail = AuditLog(store, clock)
    for i in range(7):
        await trail.append(actor="admin-key:aa" if i % 2 else "cli:ops", action="keys.create", target=f"k{i}")
        clock.advance(10)
    await trail.append(actor="signal:SIGHUP", action="config.reload", client="local", via="signal")
    everything = (await trail.query(limit=100)).entries
    assert [e.target for e in everything] == [None, "k6", "k5", "k4", "k3", "k2", "k1", "k0"]
    assert [e.target for e in (await trail.query(actor="admin-key:aa")).entries] == ["k5", "k3", "k1"]
    assert [e.action for e in (await trail.query(action="config")).entries] == ["config.reload"]
    assert (await trail.query(action="keys.cr")).entries == []  # a prefix matches whole parts only
    start = everything[-1].at
    window = await trail.query(since=start + 15, until=start + 45)
    assert [e.target for e in window.entries] == ["k4", "k3", "k2"]
    pages, cursor = [], None
    while True:
        page = await trail.query(limit=3, cursor=cursor)
        pages += [e.id for e in page.entries]
        if page.next is None:
            break
        cursor = page.next
    assert pages == [e.id for e in everything]


async def test_replicas_share_the_trail(replicas, clock: FakeClock) -> None:  # noqa: ANN001
    one, two = await replicas(), await replicas()
    try:
        await AuditLog(one, clock).append(actor="a", action="keys.revoke", target="k")
        clock.advance(1)
        await AuditLog(two, clock).append(actor="b", action="keys.create", target="k2")
        seen = (await AuditLog(one, clock).query()).entries
        assert [(e.actor, e.action) for e in seen] == [("b", "keys.create"), ("a", "keys.revoke")]
    finally:
        await one.close()
        await two.close()


async def test_secret_named_fields_never_enter_an_entry(store: StateStore, clock: FakeClock) -> None:
    trail = AuditLog(store, clock)
    await trail.append(
        actor="a",
        action="keys.create",
        after={"key_id": "k", "key": "fg-k-SECRET", "nested": [{"token": "SECRET", "ok": 1}]},
    )
    (entry,) = (await trail.query()).entries
    assert entry.after == {"key_id": "k", "key": "[redacted]", "nested": [{"token": "[redacted]", "ok": 1}]}


async def test_entries_at_one_instant_get_distinct_ids(store: StateStore, clock: FakeClock) -> None:
    trail = AuditLog(store, clock)
    for _ in range(5):
        await trail.append(actor="a", action="keys.create")
    assert len({e.id for e in (await trail.query()).entries}) == 5


def test_times_parse_as_iso_or_epoch() -> None:
    assert parse_when("1700000000") == 1700000000.0
    assert parse_when("2023-11-14T22:13:20Z") == 1700000000.0
    assert parse_when("2023-11-14T22:13:20") == 1700000000.0  # naive: UTC
    for bad in ("yesterday", "nan", "inf"):
        with pytest.raises(ValueError):
            parse_when(bad)
