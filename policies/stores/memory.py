"""`memory://`: state in this process's dicts. For tests and a single process; lost on exit.

Each method runs without awaiting in between, so on one event loop it is atomic by construction.
"""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from policies.pricing import usd
from policies.stores import _engine
from policies.stores.base import (
    SETTLE_MEMORY_S,
    AcquireResult,
    BucketOp,
    CounterOp,
    Journal,
    LeaseOp,
    Mark,
    StateStore,
    UsageDelta,
)
from policies.types import KeyRecord, KeyUsageRow, UsageRow


class _MemoryTxn:
    """The `_engine.Txn` view of a MemoryStore's dicts (changes apply at once)."""

    def __init__(self, store: MemoryStore) -> None:
        self.s = store

    def get_buckets(self, keys: list[str]) -> list[tuple[float, float] | None]:
        return [self.s.buckets.get(key) for key in keys]

    def set_buckets(self, rows: list[tuple[str, float, float]]) -> None:
        for key, level, ts in rows:
            self.s.buckets[key] = (level, ts)

    def adjust_buckets(self, ops: list[BucketOp], now: float) -> None:
        for op in ops:
            self.s.buckets[op.key] = _engine.adjust(self.s.buckets.get(op.key), op, now)

    def lease_count(self, key: str, now: float) -> int:
        held = self.s.leases.get(key, {})
        for lease_id in [lid for lid, exp in held.items() if exp <= now]:
            del held[lease_id]
        return len(held)

    def add_lease(self, key: str, lease_id: str, expires_at: float) -> None:
        self.s.leases.setdefault(key, {})[lease_id] = expires_at

    def remove_lease(self, key: str, lease_id: str, now: float) -> None:
        # expired leases need no sweep here: `lease_count` drops them as it counts
        self.s.leases.get(key, {}).pop(lease_id, None)

    def get_counters(self, keys: list[str]) -> list[int]:
        return [self.s.counters.get(key, (0, 0.0))[0] for key in keys]

    def add_counters(self, rows: list[tuple[str, int, float]]) -> None:
        for key, delta, expires_at in rows:
            self.s.counters[key] = (max(0, self.s.counters.get(key, (0, 0.0))[0] + delta), expires_at)

    def add_usage(self, rows: list[UsageDelta]) -> None:
        for usage in rows:
            table: dict = self.s.usage_rows if usage.key_id is None else self.s.key_usage_rows
            k = (usage.tenant, usage.model, usage.period)
            if usage.key_id is not None:
                k = (usage.tenant, usage.key_id, usage.model, usage.deployment, usage.period)
            requests, tokens, cost = table.get(k, (0, 0, 0))
            table[k] = (requests + usage.requests, tokens + usage.tokens, cost + usage.cost_micros)

    def mark_settled(self, settle_id: str, now: float) -> bool:
        if settle_id in self.s.settled:
            return False
        self.s.settled[settle_id] = now
        return True

    def put_journal(self, reservation_id: str, instance: str, payload: str) -> None:
        self.s.journal[reservation_id] = (instance, payload)

    def drop_journal(self, reservation_id: str) -> None:
        self.s.journal.pop(reservation_id, None)

    def put_mark(self, key: str, field: str, value: str) -> None:
        self.s.marks.setdefault(key, {})[field] = value

    def get_mark(self, key: str, field: str) -> str | None:
        return self.s.marks.get(key, {}).get(field)


class MemoryStore(StateStore):
    """State in dicts of this process."""

    def __init__(self) -> None:
        self.buckets: dict[str, tuple[float, float]] = {}
        self.leases: dict[str, dict[str, float]] = {}
        self.counters: dict[str, tuple[int, float]] = {}
        #: (tenant, model, period) -> (requests, tokens, cost in micro-USD)
        self.usage_rows: dict[tuple[str, str, str], tuple[int, int, int]] = {}
        #: (tenant, key, model, deployment, day) -> (requests, tokens, cost in micro-USD)
        self.key_usage_rows: dict[tuple[str, str, str, str, str], tuple[int, int, int]] = {}
        self.settled: dict[str, float] = {}
        self.keys: dict[str, tuple[KeyRecord, str]] = {}
        #: open reservations: id -> (instance, encoded Journal); instance -> heartbeat expiry
        self.journal: dict[str, tuple[str, str]] = {}
        self.instances: dict[str, float] = {}
        #: documents: (kind, id) -> (tenant, created_at, body); marks: map key -> field -> value
        self.records: dict[tuple[str, str], tuple[str, float, str]] = {}
        self.marks: dict[str, dict[str, str]] = {}
        self._ops = 0

    def _gc(self, now: float) -> None:
        # Forget settled ids and counters of past periods now and then, so memory stays bounded.
        self._ops += 1
        if self._ops % 4096:
            return
        self.settled = {k: t for k, t in self.settled.items() if t > now - SETTLE_MEMORY_S}
        self.counters = {k: v for k, v in self.counters.items() if v[1] > now}

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
        urgent: bool = False,  # answered at once always
    ) -> AcquireResult:
        self._gc(now)
        return _engine.acquire(
            _MemoryTxn(self),
            lease_id=lease_id,
            lease_ttl_s=lease_ttl_s,
            buckets=buckets,
            leases=leases,
            counters=counters,
            now=now,
            journal=journal,
        )

    async def heartbeat(self, instance: str, expires_at: float) -> None:
        self.instances[instance] = expires_at

    async def orphans(self, now: float) -> list[tuple[str, Journal]]:
        return [
            (rid, _engine.decode_journal(payload))
            for rid, (instance, payload) in list(self.journal.items())
            if self.instances.get(instance, 0.0) <= now
        ]

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
        return _engine.settle(
            _MemoryTxn(self),
            settle_id=settle_id,
            lease_id=lease_id,
            buckets=buckets,
            release=release,
            counters=counters,
            usage=usage,
            now=now,
            marks=marks,
        )

    async def renew(self, *, lease_id: str, keys: list[str], ttl_s: float, now: float) -> None:
        for key in keys:
            held = self.leases.get(key, {})
            if lease_id in held:
                held[lease_id] = now + ttl_s

    async def usage(self, tenant: str | None = None) -> list[UsageRow]:
        return [
            UsageRow(tenant=t, model=m, period=p, requests=r, tokens=k, cost_usd=usd(c))
            for (t, m, p), (r, k, c) in sorted(self.usage_rows.items())
            if tenant is None or t == tenant
        ]

    async def key_usage(self, tenant: str | None = None) -> list[KeyUsageRow]:
        return [
            KeyUsageRow(
                tenant=t, key_id=k, model=m, deployment=d, period=p, requests=r, tokens=n, cost_usd=usd(c)
            )
            for (t, k, m, d, p), (r, n, c) in sorted(self.key_usage_rows.items())
            if tenant is None or t == tenant
        ]

    async def put_key(self, record: KeyRecord, secret_hash: str) -> bool:
        if record.key_id in self.keys:
            return False
        self.keys[record.key_id] = (record, secret_hash)
        return True

    async def get_key(self, key_id: str) -> tuple[KeyRecord, str] | None:
        return self.keys.get(key_id)

    async def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        records = [r for r, _ in self.keys.values() if tenant is None or r.tenant == tenant]
        return sorted(records, key=lambda r: (r.created_at, r.key_id))

    async def touch_key(self, key_id: str, at: float) -> None:
        found = self.keys.get(key_id)
        if found is None:
            return
        record, secret_hash = found
        if record.last_used_at is None or record.last_used_at.timestamp() < at:
            used = msgspec.structs.replace(record, last_used_at=datetime.fromtimestamp(at, UTC))
            self.keys[key_id] = (used, secret_hash)

    async def revoke_key(self, key_id: str, now: float) -> bool:
        found = self.keys.get(key_id)
        if found is None:
            return False
        record, secret_hash = found
        if record.revoked_at is None:
            revoked = msgspec.structs.replace(record, revoked_at=datetime.fromtimestamp(now, UTC))
            self.keys[key_id] = (revoked, secret_hash)
        return True

    async def put_record(self, kind: str, record_id: str, tenant: str, created_at: float, body: str) -> None:
        self.records[(kind, record_id)] = (tenant, created_at, body)

    async def get_record(self, kind: str, record_id: str) -> tuple[str, str] | None:
        found = self.records.get((kind, record_id))
        return None if found is None else (found[0], found[2])

    async def list_records(
        self, kind: str, tenant: str, *, after: str | None = None, limit: int = 20
    ) -> list[str]:
        rows = [(c, rid, b) for (k, rid), (t, c, b) in self.records.items() if k == kind and t == tenant]
        rows.sort(reverse=True)
        start = next((i + 1 for i, (_, rid, _) in enumerate(rows) if rid == after), 0)
        return [body for _, _, body in rows[start : start + limit]]

    async def delete_record(self, kind: str, record_id: str) -> bool:
        return self.records.pop((kind, record_id), None) is not None

    async def put_marks(self, marks: list[Mark]) -> None:
        txn = _MemoryTxn(self)
        for m in marks:
            txn.put_mark(m.key, m.field, m.value)

    async def get_marks(self, key: str) -> dict[str, str]:
        return dict(self.marks.get(key, {}))

    async def drop_marks(self, key: str, fields: list[str] | None = None) -> None:
        if fields is None:
            self.marks.pop(key, None)
            return
        held = self.marks.get(key, {})
        for f in fields:
            held.pop(f, None)

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None
