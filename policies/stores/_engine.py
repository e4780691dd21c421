"""Acquire/settle logic over a transaction, shared by the memory and SQLite stores.

Each store supplies a `Txn` (plain dicts for memory, one `BEGIN IMMEDIATE` transaction for SQLite);
these functions hold the rules, so both stores answer alike. Redis runs the same rules in Lua.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from policies.stores import token_bucket
from policies.stores.base import (
    AcquireResult,
    BucketOp,
    BucketView,
    CounterOp,
    Denial,
    Journal,
    LeaseOp,
    Mark,
    UsageDelta,
)


class Txn(Protocol):
    """State access inside one atomic transaction."""

    def get_bucket(self, key: str) -> tuple[float, float] | None: ...
    def set_bucket(self, key: str, level: float, ts: float) -> None: ...
    def lease_count(self, key: str, now: float) -> int: ...  # drops expired leases first
    def add_lease(self, key: str, lease_id: str, expires_at: float) -> None: ...
    def remove_lease(self, key: str, lease_id: str) -> None: ...
    def get_counter(self, key: str) -> int: ...
    def add_counter(self, key: str, delta: int, expires_at: float) -> int: ...
    def add_usage(self, usage: UsageDelta) -> None: ...
    def mark_settled(self, settle_id: str, now: float) -> bool: ...  # False if already there
    def put_journal(self, reservation_id: str, instance: str, payload: str) -> None: ...
    def drop_journal(self, reservation_id: str) -> None: ...
    def put_mark(self, key: str, field: str, value: str) -> None: ...
    def get_mark(self, key: str, field: str) -> str | None: ...


def acquire(
    txn: Txn,
    *,
    lease_id: str,
    lease_ttl_s: float,
    buckets: list[BucketOp],
    leases: list[LeaseOp],
    counters: list[CounterOp],
    now: float,
    journal: Journal | None = None,
) -> AcquireResult:
    """Check every op, then apply all of them or none (see `StateStore.acquire`)."""
    denials: list[Denial] = []
    levels: list[float] = []
    for i, op in enumerate(buckets):
        state = txn.get_bucket(op.key)
        level = token_bucket.drain(state[0], state[1], op.rate_per_s, now) if state else 0.0
        levels.append(level)
        if not token_bucket.fits(level, op.capacity, op.cost):
            denials.append(
                Denial("bucket", i, token_bucket.retry_after(level, op.capacity, op.rate_per_s, op.cost))
            )
    for i, lease in enumerate(leases):
        if txn.lease_count(lease.key, now) >= lease.limit:
            denials.append(Denial("lease", i, None))
    used = [txn.get_counter(c.key) for c in counters]
    for i, c in enumerate(counters):
        if c.limit is not None and used[i] + c.cost > c.limit:
            denials.append(Denial("counter", i, None))
    if denials:
        views = [_view(level, op) for level, op in zip(levels, buckets, strict=True)]
        return AcquireResult(False, views, used, denials)
    views = []
    for level, op in zip(levels, buckets, strict=True):
        state = txn.get_bucket(op.key)
        txn.set_bucket(op.key, level + op.cost, max(now, state[1]) if state else now)
        views.append(_view(level + op.cost, op))
    for lease in leases:
        txn.add_lease(lease.key, lease_id, now + lease_ttl_s)
    after = [txn.add_counter(c.key, c.cost, c.expires_at) for c in counters]
    if journal is not None:
        txn.put_journal(lease_id, journal.instance, encode_journal(journal))
    return AcquireResult(True, views, after, [])


def encode_journal(journal: Journal) -> str:
    return msgspec.json.encode(journal).decode()


def decode_journal(payload: str | bytes) -> Journal:
    return msgspec.json.decode(payload, type=Journal)


def settle(
    txn: Txn,
    *,
    settle_id: str,
    lease_id: str,
    buckets: list[BucketOp],
    release: list[str],
    counters: list[CounterOp],
    usage: list[UsageDelta],
    now: float,
    marks: list[Mark] | None = None,
) -> bool:
    """Apply a reconciliation once per settle_id (see `StateStore.settle`)."""
    for mark in marks or ():
        found = txn.get_mark(mark.key, mark.field)
        if found is not None and found != mark.value:
            return False  # another attempt's settlement carries this record: never bill it twice
    if not txn.mark_settled(settle_id, now):
        return False
    txn.drop_journal(settle_id)
    for op in buckets:
        state = txn.get_bucket(op.key)
        level = token_bucket.drain(state[0], state[1], op.rate_per_s, now) if state else 0.0
        txn.set_bucket(op.key, max(0.0, level + op.cost), max(now, state[1]) if state else now)
    for key in release:
        txn.remove_lease(key, lease_id)
    for c in counters:
        txn.add_counter(c.key, c.cost, c.expires_at)
    for row in usage:
        txn.add_usage(row)
    for mark in marks or ():
        txn.put_mark(mark.key, mark.field, mark.value)
    return True


def _view(level: float, op: BucketOp) -> BucketView:
    return BucketView(token_bucket.remaining(level, op.capacity), token_bucket.reset_s(level, op.rate_per_s))
