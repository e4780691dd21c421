"""`SqliteStore`: the `StateStore` operations (limits, leases, settles, usage, keys, records, marks)
as SQL on one file, each run through the store's group commit (`group_commit.py`)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

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
    encode_key_policy,
    to_epoch,
)
from policies.stores.sqlite.group_commit import GroupCommit
from policies.stores.sqlite.schema import KEY_COLUMNS, key_from_row
from policies.stores.sqlite.txn import SqliteTxn
from policies.types import KeyRecord, KeyUsageRow, UsageRow

#: an urgent `settle_many` larger than this (a backlog after an outage) goes to the store's thread:
#: committed on the event loop, it would stall every request for as long as it takes
_URGENT_SETTLES_AT_MOST = 64


class SqliteStore(GroupCommit, StateStore):
    """State in one SQLite file (WAL), used through a single dedicated thread."""

    def __init__(self, path: str, *, synchronous: str = "NORMAL", busy_timeout_ms: int = 5000) -> None:
        super().__init__(path, synchronous=synchronous, busy_timeout_ms=busy_timeout_ms)
        self._ops = 0  # settles so far: every 1024th also forgets old settle ids and counters

    @classmethod
    async def open(cls, url: str) -> SqliteStore:
        """Open `sqlite:///relative/path` or `sqlite:////absolute/path`.

        Options: `?synchronous=full` (an fsync per commit: survives a power loss; groups then
        always commit on the store's thread), `?commit=thread` (commit every group on the thread
        even at `synchronous=normal`, as before groups ran on the loop; `loop` is the default).
        """
        rest = url.removeprefix("sqlite:///")
        path, _, query = rest.partition("?")
        if not path:
            raise ValueError(f"sqlite URL needs a file path: {url!r}")
        options = {k: v[-1] for k, v in parse_qs(query).items()}
        commit = options.get("commit", "loop").lower()
        if commit not in ("loop", "thread"):
            raise ValueError(f"sqlite commit must be loop or thread, got {commit!r}")
        store = cls(path, synchronous=options.get("synchronous", "normal"))
        await store._run(store._connect)
        if store._synchronous == "NORMAL" and commit == "loop":
            store._loop_conn = store._open_loop_connection()
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
        urgent: bool = False,
    ) -> AcquireResult:
        return await self._tx(
            lambda c: _engine.acquire(
                SqliteTxn(c),
                lease_id=lease_id,
                lease_ttl_s=lease_ttl_s,
                buckets=buckets,
                leases=leases,
                counters=counters,
                now=now,
                journal=journal,
            ),
            urgent=urgent,
        )

    async def heartbeat(self, instance: str, expires_at: float) -> None:
        await self._tx(
            lambda c: c.execute("INSERT OR REPLACE INTO instances VALUES (?, ?)", (instance, expires_at))
        )

    async def orphans(self, now: float) -> list[tuple[str, Journal]]:
        def run(c: sqlite3.Connection) -> list[tuple[str, str]]:
            c.execute("DELETE FROM instances WHERE expires_at <= ?", (now - 86400,))  # long gone
            return c.execute(
                "SELECT j.id, j.payload FROM journal j LEFT JOIN instances i ON i.id = j.instance "
                "WHERE i.expires_at IS NULL OR i.expires_at <= ?",
                (now,),
            ).fetchall()

        return [(rid, _engine.decode_journal(payload)) for rid, payload in await self._tx(run)]

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
        settle = dict(settle_id=settle_id, lease_id=lease_id, buckets=buckets, release=release,
                      counters=counters, usage=usage, now=now, marks=marks)  # fmt: skip
        return await self._tx(self._settle_work(settle))

    async def settle_many(self, settles: list[dict[str, Any]], *, urgent: bool = False) -> list[bool | BaseException]:
        work = [self._settle_work(s) for s in settles]
        if urgent and len(work) <= _URGENT_SETTLES_AT_MOST:
            answered = self._commit_now_all(work)
            if answered is not None:
                return [value for _, value in answered]  # type: ignore[misc]
        return await asyncio.gather(*(self._tx(fn) for fn in work), return_exceptions=True)

    def _settle_work(self, settle: dict[str, Any]) -> Callable[[sqlite3.Connection], bool]:
        """One settle (`settle`'s keyword arguments) as the work of a transaction."""
        self._ops += 1
        gc = self._ops % 1024 == 0
        now = settle["now"]

        def run(c: sqlite3.Connection) -> bool:
            if gc:  # forget old settle ids and counters of past periods now and then
                c.execute("DELETE FROM settled WHERE at < ?", (now - SETTLE_MEMORY_S,))
                c.execute("DELETE FROM counters WHERE expires_at < ?", (now,))
            return _engine.settle(SqliteTxn(c), **settle)

        return run

    async def renew(self, *, lease_id: str, keys: list[str], ttl_s: float, now: float) -> None:
        expires_at = now + ttl_s

        def run(c: sqlite3.Connection) -> None:
            for key in keys:
                c.execute(
                    "UPDATE leases SET expires_at = ? WHERE key = ? AND lease_id = ?",
                    (expires_at, key, lease_id),
                )

        await self._tx(run)

    async def _rows(self, columns: str, table: str, keys: int, tenant: str | None) -> list[tuple]:
        """`columns` of `table`, of one tenant or all, ordered by its first `keys` columns."""
        order = ", ".join(str(i) for i in range(1, keys + 1))
        sql = f"SELECT {columns} FROM {table}"  # noqa: S608 - fixed names
        if tenant is None:
            return await self._tx(lambda c: c.execute(f"{sql} ORDER BY {order}").fetchall())
        return await self._tx(lambda c: c.execute(f"{sql} WHERE tenant = ? ORDER BY {order}", (tenant,)).fetchall())

    async def usage(self, tenant: str | None = None) -> list[UsageRow]:
        rows = await self._rows("tenant, model, period, requests, tokens, cost_micros", "usage", 3, tenant)
        return [
            UsageRow(tenant=t, model=m, period=p, requests=r, tokens=k, cost_usd=usd(c)) for t, m, p, r, k, c in rows
        ]

    async def key_usage(self, tenant: str | None = None) -> list[KeyUsageRow]:
        columns = "tenant, key_id, model, deployment, period, requests, tokens, cost_micros"
        return [
            KeyUsageRow(tenant=t, key_id=k, model=m, deployment=d, period=p, requests=r, tokens=n, cost_usd=usd(c))
            for t, k, m, d, p, r, n, c in await self._rows(columns, "key_usage", 5, tenant)
        ]

    async def put_key(self, record: KeyRecord, secret_hash: str) -> bool:
        values = (
            record.key_id,
            record.tenant,
            secret_hash,
            json.dumps(list(record.models)),
            record.name,
            to_epoch(record.created_at),
            to_epoch(record.expires_at),
            to_epoch(record.revoked_at),
            encode_key_policy(record),
        )
        sql = (
            "INSERT OR IGNORE INTO keys (key_id, tenant, hash, models, name, created_at, expires_at, revoked_at, "
            "policy) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
        )
        return await self._tx(lambda c: c.execute(sql, values).rowcount == 1)

    async def get_key(self, key_id: str) -> tuple[KeyRecord, str] | None:
        def run(c: sqlite3.Connection) -> tuple | None:
            sql = f"SELECT {KEY_COLUMNS}, hash FROM keys WHERE key_id = ?"
            return c.execute(sql, (key_id,)).fetchone()

        # through the group like every operation: the store's one thread is never held by a
        # drain that a separate read would have to wait behind
        row = await self._tx(run)
        return None if row is None else (key_from_row(row[:-1]), row[-1])

    async def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        def run(c: sqlite3.Connection) -> list[tuple]:
            sql = f"SELECT {KEY_COLUMNS} FROM keys"
            if tenant is None:
                return c.execute(sql + " ORDER BY created_at, key_id").fetchall()
            return c.execute(sql + " WHERE tenant = ? ORDER BY created_at, key_id", (tenant,)).fetchall()

        return [key_from_row(row) for row in await self._tx(run)]

    async def touch_key(self, key_id: str, at: float) -> None:
        sql = "UPDATE keys SET last_used_at = ? WHERE key_id = ? AND coalesce(last_used_at, 0) < ?"
        await self._tx(lambda c: c.execute(sql, (at, key_id, at)))

    async def revoke_key(self, key_id: str, now: float) -> bool:
        def run(c: sqlite3.Connection) -> bool:
            c.execute("UPDATE keys SET revoked_at = ? WHERE key_id = ? AND revoked_at IS NULL", (now, key_id))
            return c.execute("SELECT 1 FROM keys WHERE key_id = ?", (key_id,)).fetchone() is not None

        return await self._tx(run)

    async def put_record(self, kind: str, record_id: str, tenant: str, created_at: float, body: str) -> None:
        await self._tx(
            lambda c: c.execute(
                "INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?)",
                (kind, record_id, tenant, created_at, body),
            )
        )

    async def get_record(self, kind: str, record_id: str) -> tuple[str, str] | None:
        def run(c: sqlite3.Connection) -> tuple[str, str] | None:
            sql = "SELECT tenant, body FROM records WHERE kind = ? AND id = ?"
            return c.execute(sql, (kind, record_id)).fetchone()

        return await self._tx(run)

    async def list_records(
        self, kind: str, tenant: str, *, after: str | None = None, limit: int = 20
    ) -> list[str]:
        def run(c: sqlite3.Connection) -> list[tuple[str]]:
            cursor = None
            if after is not None:
                sql = "SELECT created_at, id FROM records WHERE kind = ? AND tenant = ? AND id = ?"
                cursor = c.execute(sql, (kind, tenant, after)).fetchone()
            if cursor is None:
                sql = "SELECT body FROM records WHERE kind = ? AND tenant = ? ORDER BY created_at DESC, id DESC LIMIT ?"
                return c.execute(sql, (kind, tenant, limit)).fetchall()
            sql = (
                "SELECT body FROM records WHERE kind = ? AND tenant = ? AND (created_at, id) < (?, ?) "
                "ORDER BY created_at DESC, id DESC LIMIT ?"
            )
            return c.execute(sql, (kind, tenant, *cursor, limit)).fetchall()

        return [row[0] for row in await self._tx(run)]

    async def delete_record(self, kind: str, record_id: str) -> bool:
        def run(c: sqlite3.Connection) -> bool:
            return c.execute("DELETE FROM records WHERE kind = ? AND id = ?", (kind, record_id)).rowcount == 1

        return await self._tx(run)

    async def put_marks(self, marks: list[Mark]) -> None:
        def run(c: sqlite3.Connection) -> None:
            txn = SqliteTxn(c)
            for m in marks:
                txn.put_mark(m.key, m.field, m.value)

        await self._tx(run)

    async def get_marks(self, key: str) -> dict[str, str]:
        def run(c: sqlite3.Connection) -> list[tuple[str, str]]:
            return c.execute("SELECT field, value FROM marks WHERE key = ?", (key,)).fetchall()

        return dict(await self._tx(run))

    async def drop_marks(self, key: str, fields: list[str] | None = None) -> None:
        def run(c: sqlite3.Connection) -> None:
            if fields is None:
                c.execute("DELETE FROM marks WHERE key = ?", (key,))
            else:
                c.executemany("DELETE FROM marks WHERE key = ? AND field = ?", [(key, f) for f in fields])

        await self._tx(run)

    async def ping(self) -> None:
        await self._tx(lambda c: c.execute("SELECT 1").fetchone())
