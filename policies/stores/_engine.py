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
    """State access inside one atomic transaction.

    Buckets, counters and usage rows are read and written a request's worth at a time: on SQLite
    each call is one statement (or one `executemany`), and statements are most of a request's cost.
    """

    def get_buckets(self, keys: list[str]) -> list[tuple[float, float] | None]: ...  # (level, ts) per key
    def set_buckets(self, rows: list[tuple[str, float, float]]) -> None: ...  # (key, level, ts)
    #: per op, in order: the bucket drained to `now`, then `cost` added (never below zero), at
    #: max(now, ts); a bucket not there starts empty at `now` (`adjust` below: the rule itself)
    def adjust_buckets(self, ops: list[BucketOp], now: float) -> None: ...
    def lease_count(self, key: str, now: float) -> int: ...  # leases of `key` not expired at `now`
    def add_lease(self, key: str, lease_id: str, expires_at: float) -> None: ...
    def remove_lease(self, key: str, lease_id: str, now: float) -> None: ...  # and key's expired ones
    def get_counters(self, keys: list[str]) -> list[int]: ...
    #: used = max(0, used + delta) per (key, delta, expires_at), in order
    def add_counters(self, rows: list[tuple[str, int, float]]) -> None: ...
    def add_usage(self, rows: list[UsageDelta]) -> None: ...
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
    states = txn.get_buckets([op.key for op in buckets]) if buckets else []
    for i, (op, state) in enumerate(zip(buckets, states, strict=True)):
        level = token_bucket.drain(state[0], state[1], op.rate_per_s, now) if state else 0.0
        levels.append(level)
        if not token_bucket.fits(level, op.capacity, op.cost):
            denials.append(
                Denial("bucket", i, token_bucket.retry_after(level, op.capacity, op.rate_per_s, op.cost))
            )
    for i, lease in enumerate(leases):
        if txn.lease_count(lease.key, now) >= lease.limit:
            denials.append(Denial("lease", i, None))
    used = txn.get_counters([c.key for c in counters]) if counters else []
    for i, c in enumerate(counters):
        if c.limit is not None and used[i] + c.cost > c.limit:
            denials.append(Denial("counter", i, None))
    if denials:
        views = [_view(level, op) for level, op in zip(levels, buckets, strict=True)]
        return AcquireResult(False, views, used, denials)
    if buckets:
        txn.set_buckets(
            [
                (op.key, level + op.cost, max(now, state[1]) if state else now)
                for op, level, state in zip(buckets, levels, states, strict=True)
            ]
        )
    views = [_view(level + op.cost, op) for level, op in zip(levels, buckets, strict=True)]
    for lease in leases:
        txn.add_lease(lease.key, lease_id, now + lease_ttl_s)
    if counters:
        txn.add_counters([(c.key, c.cost, c.expires_at) for c in counters])
    if journal is not None:
        txn.put_journal(lease_id, journal.instance, encode_journal(journal))
    return AcquireResult(True, views, _counts_after(counters, used), [])


def _counts_after(counters: list[CounterOp], used: list[int]) -> list[int]:
    """What `add_counters` left in each counter, in order (a key may repeat)."""
    current = dict(zip((c.key for c in counters), used, strict=True))
    after = []
    for c in counters:
        current[c.key] = max(0, current[c.key] + c.cost)
        after.append(current[c.key])
    return after


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
    if buckets:
        txn.adjust_buckets(buckets, now)
    for key in release:
        txn.remove_lease(key, lease_id, now)
    if counters:
        txn.add_counters([(c.key, c.cost, c.expires_at) for c in counters])
    if usage:
        txn.add_usage(usage)
    for mark in marks or ():
        txn.put_mark(mark.key, mark.field, mark.value)
    return True


def adjust(state: tuple[float, float] | None, op: BucketOp, now: float) -> tuple[float, float]:
    """A bucket's (level, ts) after a settle's correction `op.cost` (a refund when negative): its
    level drained to `now` plus the cost, never below zero. SQLite's `adjust_buckets` writes the
    same arithmetic in SQL, operation for operation, so both stores answer alike."""
    if state is None:
        return max(0.0, 0.0 + op.cost), now
    level = token_bucket.drain(state[0], state[1], op.rate_per_s, now)
    return max(0.0, level + op.cost), max(now, state[1])


def _view(level: float, op: BucketOp) -> BucketView:
    return BucketView(token_bucket.remaining(level, op.capacity), token_bucket.reset_s(level, op.rate_per_s))
