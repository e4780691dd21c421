"""The StateStore interface and the plain data it exchanges.

A store knows nothing about tenants or HTTP: it holds token buckets, concurrency leases, period
counters, usage rows and API keys, and applies a whole admission (`acquire`) or a whole reconciliation
(`settle`) atomically, all-or-nothing. Atomicity lives in the store (one SQLite `BEGIN IMMEDIATE`
transaction, one Redis Lua script), so limits hold across replicas sharing the same store.
"""

from __future__ import annotations

import abc
import asyncio
from datetime import UTC, datetime
from typing import Any, Literal

import msgspec

from policies.types import Budget, KeyRecord, KeyUsageRow, Limits, UsageRow


class BucketOp(msgspec.Struct, frozen=True):
    """Take `cost` units from a token bucket (negative cost: give units back).

    The bucket holds `capacity` units and refills at `rate_per_s`; its state is the level used.
    """

    key: str
    capacity: float
    rate_per_s: float
    cost: float


class LeaseOp(msgspec.Struct, frozen=True):
    """Hold one concurrency slot of `key`, whose size is `limit`."""

    key: str
    limit: int


class CounterOp(msgspec.Struct, frozen=True):
    """Add `cost` to a period counter, refused if it would pass `limit` (None: never refused).

    `expires_at` (epoch s) is when the store may forget the counter (after its period ends).
    """

    key: str
    limit: int | None
    cost: int
    expires_at: float


class Journal(msgspec.Struct, frozen=True):
    """What an admitted request (or a lease's slice) holds, recorded with it so that it can be given
    back if the process that took it dies before settling: its concurrency leases, its period-counter
    reservations and the bucket units of a slice.
    """

    #: the gateway process that admitted it (its heartbeat says whether it is alive)
    instance: str
    leases: list[str]
    counters: list[CounterOp]
    #: bucket units taken ahead of requests (a lease's slice, policies/leases): given back with it
    buckets: list[BucketOp] = msgspec.field(default_factory=list)


class UsageDelta(msgspec.Struct, frozen=True):
    """Add to the usage row of (tenant, model, period); `cost_micros` is the spend in micro-USD.

    With `key_id` set it adds to the per-key row of (tenant, key_id, model, deployment, period)
    instead, kept apart from the tenant's rows (`StateStore.key_usage`).
    """

    tenant: str
    model: str
    period: str
    requests: int
    tokens: int
    cost_micros: int = 0
    key_id: str | None = None
    deployment: str = ""


class Mark(msgspec.Struct, frozen=True):
    """Set `field` of the named map `key` to `value` (batch jobs' per-line records, cancel requests).

    Handed to `settle`, marks are written in the same atomic step as the settlement they go with,
    so "this line is done" and "this line is on the bill" are never true one without the other.
    """

    key: str
    field: str
    value: str


class BucketView(msgspec.Struct, frozen=True):
    """A bucket after an acquire: units left now, seconds until it is full again."""

    remaining: float
    reset_s: float


class Denial(msgspec.Struct, frozen=True):
    """Why an acquire was refused: which op (`kind` and index in its list) and when to retry.

    `retry_after_s` is None when waiting cannot help (a cost above the capacity, a spent quota).
    """

    kind: Literal["bucket", "lease", "counter"]
    index: int
    retry_after_s: float | None


class AcquireResult(msgspec.Struct, frozen=True):
    """Outcome of `StateStore.acquire`.

    Attributes:
        ok: True when every op was applied; False when none was.
        buckets: one view per bucket op (after the op when ok, the current state otherwise).
        counters: value of each counter (after the op when ok, the current value otherwise).
        denials: every op that refused (empty when ok).
    """

    ok: bool
    buckets: list[BucketView]
    counters: list[int]
    denials: list[Denial]


#: How long a settle id is remembered so that a repeated settle is a no-op. A settle is repeated
#: only by the process that deferred it while the store was down; an hour bounds the table at
#: (requests/s x 3600) rows, where two days grew it without bound with the request rate.
SETTLE_MEMORY_S = 3600.0


class StateStore(abc.ABC):
    """Shared policy state. Every method raises `StoreUnavailable` when the store cannot be reached."""

    @abc.abstractmethod
    async def acquire(
        self,
        *,
        lease_id: str,
        lease_ttl_s: float,
        buckets: list[BucketOp],
        leases: list[LeaseOp],
        counters: list[CounterOp],
        now: float,
        journal: Journal | None = None,
        urgent: bool = False,
    ) -> AcquireResult:
        """Apply every op, or none of them if any one refuses. Expired leases are dropped first.

        With `journal`, an admission that passes also records it under `lease_id` (same atomic step);
        the settle of that id removes it. `urgent`: the caller holds other requests waiting (the
        lease path's top-up lock), so the store answers it as soon as it can rather than gathering
        it with others (SQLite commits it at once on the event loop; the others have no gathering).
        """

    @abc.abstractmethod
    async def settle(
        self,
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
        """Adjust buckets and counters (limits ignored), release leases, add usage; once per settle_id.

        `marks` are written in the same atomic step, and only when the settle is applied. A mark
        already set to another value refuses the whole settle: the record it marks (a batch line) is
        carried by another attempt's settlement, so this one must not bill it again.

        Returns:
            False when this settle_id was already applied, or a mark refused it (nothing is done).
        """

    async def settle_many(self, settles: list[dict[str, Any]], *, urgent: bool = False) -> list[bool | BaseException]:
        """Several settles (each one `settle`'s keyword arguments), each applied or refused on its
        own: each one's answer, or the error it met, in order. `urgent` as for `acquire`.

        Sent together (Redis pipelines them in one round trip); SQLite applies them in one
        transaction, each in its own savepoint, and when urgent commits them at once on the loop."""
        return await asyncio.gather(*(self.settle(**s) for s in settles), return_exceptions=True)

    @abc.abstractmethod
    async def heartbeat(self, instance: str, expires_at: float) -> None:
        """Say that process `instance` is alive until `expires_at` (epoch s)."""

    @abc.abstractmethod
    async def orphans(self, now: float) -> list[tuple[str, Journal]]:
        """(reservation id, journal) of the open reservations whose process has no live heartbeat."""

    @abc.abstractmethod
    async def renew(self, *, lease_id: str, keys: list[str], ttl_s: float, now: float) -> None:
        """Set the expiry of this lease in each of `keys` to now + ttl_s (long streams keep their slot)."""

    @abc.abstractmethod
    async def usage(self, tenant: str | None = None) -> list[UsageRow]:
        """Usage rows, of one tenant or of all, sorted by tenant, model, period."""

    @abc.abstractmethod
    async def key_usage(self, tenant: str | None = None) -> list[KeyUsageRow]:
        """Per-key usage rows, of one tenant or of all, sorted by tenant, key, model, deployment, period."""

    @abc.abstractmethod
    async def put_key(self, record: KeyRecord, secret_hash: str) -> bool:
        """Store a new key; False (nothing stored) when its key_id already exists."""

    @abc.abstractmethod
    async def get_key(self, key_id: str) -> tuple[KeyRecord, str] | None:
        """The key record and its secret hash, or None."""

    @abc.abstractmethod
    async def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        """Key records, of one tenant or of all, sorted by creation time."""

    @abc.abstractmethod
    async def touch_key(self, key_id: str, at: float) -> None:
        """Record that the key authenticated at `at` (kept only when later than what is stored)."""

    @abc.abstractmethod
    async def revoke_key(self, key_id: str, now: float) -> bool:
        """Mark a key revoked (kept for audit). False when no such key exists."""

    # --- documents and marks (batch jobs and their files, gateway/batches) ----------------------

    @abc.abstractmethod
    async def put_record(self, kind: str, record_id: str, tenant: str, created_at: float, body: str) -> None:
        """Create or replace the document `record_id` of `kind`, owned by `tenant`."""

    @abc.abstractmethod
    async def get_record(self, kind: str, record_id: str) -> tuple[str, str] | None:
        """(tenant, body) of a document, or None."""

    @abc.abstractmethod
    async def list_records(
        self, kind: str, tenant: str, *, after: str | None = None, limit: int = 20
    ) -> list[str]:
        """Bodies of `tenant`'s documents of `kind`, newest first (by created_at, then id), starting
        after the document `after` (a cursor from a previous page; unknown: from the start)."""

    @abc.abstractmethod
    async def delete_record(self, kind: str, record_id: str) -> bool:
        """Remove a document; False when there was none."""

    @abc.abstractmethod
    async def put_marks(self, marks: list[Mark]) -> None:
        """Write marks (each `key.field = value`), all in one atomic step."""

    @abc.abstractmethod
    async def get_marks(self, key: str) -> dict[str, str]:
        """Every field of the map `key` (empty when there is none)."""

    @abc.abstractmethod
    async def drop_marks(self, key: str, fields: list[str] | None = None) -> None:
        """Remove `fields` of the map `key`, or the whole map when `fields` is None."""

    @abc.abstractmethod
    async def ping(self) -> None:
        """Raise `StoreUnavailable` unless the store answers."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections and threads. Idempotent."""


def to_epoch(value: datetime | None) -> float | None:
    """Epoch seconds of an aware datetime (naive ones are taken as UTC), or None."""
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.timestamp()


def from_epoch(value: float | None) -> datetime | None:
    """The UTC datetime of epoch seconds, or None."""
    return None if value is None else datetime.fromtimestamp(value, UTC)


class KeyPolicy(msgspec.Struct, frozen=True, omit_defaults=True):
    """A key's own limits and budget, as stores keep them (one JSON text beside the key's fields)."""

    limits: Limits | None = None
    budget: Budget | None = None


def encode_key_policy(record: KeyRecord) -> str | None:
    """The stored form of a key's own limits and budget; None when it has neither."""
    if record.limits is None and record.budget is None:
        return None
    return msgspec.json.encode(KeyPolicy(record.limits, record.budget)).decode()


def decode_key_policy(text: str | None) -> KeyPolicy:
    """A key's own limits and budget from their stored form (none for keys made before them)."""
    return KeyPolicy() if not text else msgspec.json.decode(text, type=KeyPolicy)
