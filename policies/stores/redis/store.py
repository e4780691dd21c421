"""`RedisStore`: the `StateStore` operations on one Redis database, every check-and-update an
atomic Lua script (`lua.py`) sent through the store's pipeline (`pipeline.py`)."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from policies.pricing import usd
from policies.stores import _engine
from policies.stores.base import (
    SETTLE_MEMORY_S,
    AcquireResult,
    BucketOp,
    BucketView,
    CounterOp,
    Denial,
    Journal,
    LeaseOp,
    Mark,
    StateStore,
    UsageDelta,
    decode_key_policy,
    encode_key_policy,
    from_epoch,
    to_epoch,
)
from policies.stores.redis import lua
from policies.stores.redis.pipeline import ScriptPipeline
from policies.types import KeyRecord, KeyUsageRow, UsageRow


class RedisStore(ScriptPipeline, StateStore):
    """State in one Redis database, every update an atomic Lua script."""

    def __init__(self, client: Any, url: str, prefix: str = "fg:", timeout_s: float = 2.0) -> None:
        super().__init__(client, url, timeout_s)
        self._p = prefix
        self._acquire = client.register_script(lua.ACQUIRE)
        self._settle = client.register_script(lua.SETTLE)
        self._renew = client.register_script(lua.RENEW)
        self._put_key = client.register_script(lua.PUT_KEY)
        self._revoke_key = client.register_script(lua.REVOKE_KEY)
        self._touch_key = client.register_script(lua.TOUCH_KEY)

    @classmethod
    async def open(cls, url: str, *, timeout_s: float = 2.0, max_connections: int = 64) -> RedisStore:
        """Connect to `redis://[:password@]host:port/db[?prefix=fg:]` and check that it answers."""
        import redis.asyncio as aioredis

        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        prefix = query.pop("prefix", "fg:")
        clean = urlunsplit(parts._replace(query=urlencode(query)))
        # A blocking pool: a burst of admissions waits for a connection instead of failing.
        pool = aioredis.BlockingConnectionPool.from_url(
            clean,
            max_connections=max_connections,
            timeout=timeout_s,
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
        )
        client = aioredis.Redis.from_pool(pool)
        store = cls(client, url, prefix, timeout_s)
        await store.ping()
        return store

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
        urgent: bool = False,  # sent at once always (pipelined)
    ) -> AcquireResult:
        keys = [self._p + b.key for b in buckets] + [self._p + x.key for x in leases]
        keys += [self._p + c.key for c in counters] + [self._p + "journal"]
        args: list[Any] = [repr(now), lease_id, repr(lease_ttl_s), len(buckets), len(leases), len(counters)]
        for b in buckets:
            args += [repr(float(b.capacity)), repr(float(b.rate_per_s)), repr(float(b.cost))]
        args += [x.limit for x in leases]
        for c in counters:
            args += [-1 if c.limit is None else c.limit, c.cost, repr(max(1.0, c.expires_at - now))]
        args.append(_engine.encode_journal(journal) if journal is not None else "")
        out = await self._pipelined(self._acquire, keys, args)
        ok, i = out[0] == "1", 1
        views = []
        for _ in buckets:
            views.append(BucketView(float(out[i]), float(out[i + 1])))
            i += 2
        used = [int(float(v)) for v in out[i : i + len(counters)]]
        i += len(counters)
        denials = []
        while i < len(out):
            retry = float(out[i + 2])
            denials.append(Denial(out[i], int(out[i + 1]), None if retry < 0 else retry))
            i += 3
        return AcquireResult(ok, views, used, denials)

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
        marks = marks or []
        members = [_usage_member(u) for u in usage]
        keys = [self._p + "settled:" + settle_id] + [self._p + b.key for b in buckets]
        keys += [self._p + k for k in release] + [self._p + c.key for c in counters]
        keys += [self._p + "usage:" + m for m in members] + [self._p + "usage_index", self._p + "journal"]
        keys += [self._p + "mark:" + m.key for m in marks]
        args: list[Any] = [repr(now), lease_id, repr(SETTLE_MEMORY_S)]
        args += [len(buckets), len(release), len(counters), len(usage), len(marks)]
        for b in buckets:
            args += [repr(float(b.capacity)), repr(float(b.rate_per_s)), repr(float(b.cost))]
        for c in counters:
            args += [c.cost, repr(max(1.0, c.expires_at - now))]
        for u, m in zip(usage, members, strict=True):
            args += [u.requests, u.tokens, u.cost_micros, m]
        for mark in marks:
            args += [mark.field, mark.value]
        return await self._pipelined(self._settle, keys, args) == 1

    async def heartbeat(self, instance: str, expires_at: float) -> None:
        await self._call(self._client.hset(self._p + "instances", instance, repr(expires_at)))

    async def orphans(self, now: float) -> list[tuple[str, Journal]]:
        pipe = self._client.pipeline(transaction=False)
        pipe.hgetall(self._p + "journal")
        pipe.hgetall(self._p + "instances")
        journal, instances = await self._call(pipe.execute())
        out = []
        for rid, payload in journal.items():
            entry = _engine.decode_journal(payload)
            if float(instances.get(entry.instance, "0")) <= now:
                out.append((rid, entry))
        return out

    async def renew(self, *, lease_id: str, keys: list[str], ttl_s: float, now: float) -> None:
        if keys:
            args = [lease_id, repr(now + ttl_s), repr(ttl_s)]
            await self._pipelined(self._renew, [self._p + k for k in keys], args)

    async def _usage_rows(self, tenant: str | None, fields: int) -> list[tuple[list[str], list[int]]]:
        """(member fields, [requests, tokens, cost]) of the usage rows whose members have `fields`
        fields (3: a tenant's rows; 5: per-key rows), of one tenant or all."""
        members = await self._call(self._client.smembers(self._p + "usage_index"))
        parsed = [(m, json.loads(m)) for m in sorted(members)]
        wanted = [(m, f) for m, f in parsed if len(f) == fields and (tenant is None or f[0] == tenant)]
        pipe = self._client.pipeline(transaction=False)
        for m, _ in wanted:
            pipe.hmget(self._p + "usage:" + m, "requests", "tokens", "cost")
        values = await self._call(pipe.execute()) if wanted else []
        return [(f, [int(v or 0) for v in vs]) for (_, f), vs in zip(wanted, values, strict=True)]

    async def usage(self, tenant: str | None = None) -> list[UsageRow]:
        rows = [
            UsageRow(tenant=t, model=model, period=period, requests=r, tokens=n, cost_usd=usd(c))
            for (t, model, period), (r, n, c) in await self._usage_rows(tenant, 3)
        ]
        return sorted(rows, key=lambda r: (r.tenant, r.model, r.period))

    async def key_usage(self, tenant: str | None = None) -> list[KeyUsageRow]:
        rows = [
            KeyUsageRow(
                tenant=t, key_id=key_id, model=model, deployment=dep, period=period, requests=r, tokens=n,
                cost_usd=usd(c),
            )  # fmt: skip
            for (t, model, period, key_id, dep), (r, n, c) in await self._usage_rows(tenant, 5)
        ]
        return sorted(rows, key=lambda r: (r.tenant, r.key_id, r.model, r.deployment, r.period))

    async def put_key(self, record: KeyRecord, secret_hash: str) -> bool:
        fields = {
            "tenant": record.tenant,
            "hash": secret_hash,
            "models": json.dumps(list(record.models)),
            "created_at": repr(to_epoch(record.created_at)),
        }
        if record.name is not None:
            fields["name"] = record.name
        if record.expires_at is not None:
            fields["expires_at"] = repr(to_epoch(record.expires_at))
        policy = encode_key_policy(record)
        if policy is not None:
            fields["policy"] = policy
        args = [record.key_id] + [x for kv in fields.items() for x in kv]
        keys = [self._p + "key:" + record.key_id, self._p + "key_index"]
        return await self._call(self._put_key(keys=keys, args=args)) == 1

    async def get_key(self, key_id: str) -> tuple[KeyRecord, str] | None:
        found = await self._call(self._client.hgetall(self._p + "key:" + key_id))
        return (_key_from_hash(key_id, found), found["hash"]) if found else None

    async def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        ids = sorted(await self._call(self._client.smembers(self._p + "key_index")))
        pipe = self._client.pipeline(transaction=False)
        for key_id in ids:
            pipe.hgetall(self._p + "key:" + key_id)
        hashes = await self._call(pipe.execute()) if ids else []
        records = [_key_from_hash(k, h) for k, h in zip(ids, hashes, strict=True) if h]
        records = [r for r in records if tenant is None or r.tenant == tenant]
        return sorted(records, key=lambda r: (r.created_at, r.key_id))

    async def touch_key(self, key_id: str, at: float) -> None:
        await self._call(self._touch_key(keys=[self._p + "key:" + key_id], args=[repr(at)]))

    async def revoke_key(self, key_id: str, now: float) -> bool:
        result = self._revoke_key(keys=[self._p + "key:" + key_id], args=[repr(now)])
        return await self._call(result) == 1

    # Documents: one hash per document (tenant, body), and per kind and tenant a sorted set of ids
    # scored by creation time (the listing order; `after` pages by rank in it).

    def _record_key(self, kind: str, record_id: str) -> str:
        return f"{self._p}rec:{kind}:{record_id}"

    def _record_index(self, kind: str, tenant: str) -> str:
        return f"{self._p}recidx:{kind}:{tenant}"

    async def put_record(self, kind: str, record_id: str, tenant: str, created_at: float, body: str) -> None:
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(self._record_key(kind, record_id), mapping={"tenant": tenant, "body": body})
        pipe.zadd(self._record_index(kind, tenant), {record_id: created_at})
        await self._call(pipe.execute())

    async def get_record(self, kind: str, record_id: str) -> tuple[str, str] | None:
        found = await self._call(self._client.hmget(self._record_key(kind, record_id), "tenant", "body"))
        return None if found[0] is None else (found[0], found[1])

    async def list_records(
        self, kind: str, tenant: str, *, after: str | None = None, limit: int = 20
    ) -> list[str]:
        index = self._record_index(kind, tenant)
        rank = await self._call(self._client.zrevrank(index, after)) if after is not None else None
        start = 0 if rank is None else rank + 1
        ids = await self._call(self._client.zrevrange(index, start, start + limit - 1))
        pipe = self._client.pipeline(transaction=False)
        for record_id in ids:
            pipe.hget(self._record_key(kind, record_id), "body")
        bodies = await self._call(pipe.execute()) if ids else []
        return [b for b in bodies if b is not None]

    async def delete_record(self, kind: str, record_id: str) -> bool:
        key = self._record_key(kind, record_id)
        tenant = await self._call(self._client.hget(key, "tenant"))
        if tenant is None:
            return False
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(key)
        pipe.zrem(self._record_index(kind, tenant), record_id)
        await self._call(pipe.execute())
        return True

    async def put_marks(self, marks: list[Mark]) -> None:
        pipe = self._client.pipeline(transaction=True)
        for m in marks:
            pipe.hset(self._p + "mark:" + m.key, m.field, m.value)
        if marks:
            await self._call(pipe.execute())

    async def get_marks(self, key: str) -> dict[str, str]:
        return await self._call(self._client.hgetall(self._p + "mark:" + key))

    async def drop_marks(self, key: str, fields: list[str] | None = None) -> None:
        if fields is None:
            await self._call(self._client.delete(self._p + "mark:" + key))
        elif fields:
            await self._call(self._client.hdel(self._p + "mark:" + key, *fields))

    async def ping(self) -> None:
        await self._call(self._client.ping())


def _usage_member(u: UsageDelta) -> str:
    """A usage row's member of the usage index (and its hash's name): a tenant's row, or a key's."""
    if u.key_id is None:
        return json.dumps([u.tenant, u.model, u.period])
    return json.dumps([u.tenant, u.model, u.period, u.key_id, u.deployment])


def _key_from_hash(key_id: str, h: dict[str, str]) -> KeyRecord:
    def epoch(name: str) -> float | None:
        return float(h[name]) if name in h else None

    return KeyRecord(
        key_id=key_id,
        tenant=h["tenant"],
        models=json.loads(h["models"]),
        name=h.get("name"),
        created_at=from_epoch(float(h["created_at"])),
        expires_at=from_epoch(epoch("expires_at")),
        revoked_at=from_epoch(epoch("revoked_at")),
        last_used_at=from_epoch(epoch("last_used_at")),
        limits=(own := decode_key_policy(h.get("policy"))).limits,
        budget=own.budget,
    )
