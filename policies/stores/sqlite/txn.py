"""`SqliteTxn`: the `_engine.Txn` view of one open SQLite transaction (the engine's reads and writes
of buckets, leases, counters, usage, settle ids, journals and marks, as SQL statements)."""

from __future__ import annotations

import sqlite3

from policies.stores.base import BucketOp, UsageDelta
from policies.stores.sqlite.schema import select_in


class SqliteTxn:
    """The `_engine.Txn` view of one open SQLite transaction."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.c = conn

    def get_buckets(self, keys: list[str]) -> list[tuple[float, float] | None]:
        found = {key: (level, ts) for key, level, ts in self.c.execute(select_in("key, level, ts", "buckets", len(keys)), keys)}  # fmt: skip
        return [found.get(key) for key in keys]

    def set_buckets(self, rows: list[tuple[str, float, float]]) -> None:
        self.c.executemany(
            "INSERT INTO buckets (key, level, ts) VALUES (?, ?, ?) "
            "ON CONFLICT (key) DO UPDATE SET level = excluded.level, ts = excluded.ts",
            rows,
        )

    def adjust_buckets(self, ops: list[BucketOp], now: float) -> None:
        # `_engine.adjust` in one statement instead of a read and a write: the same IEEE operations
        # in the same order (elapsed clamped at 0, times the rate, off the level, clamped, plus cost)
        self.c.executemany(
            "INSERT INTO buckets (key, level, ts) VALUES (?1, max(0.0, 0.0 + ?2), ?3) "
            "ON CONFLICT (key) DO UPDATE SET "
            "level = max(0.0, max(0.0, level - max(0.0, ?3 - ts) * ?4) + ?2), ts = max(?3, ts)",
            [(op.key, op.cost, now, op.rate_per_s) for op in ops],
        )

    def lease_count(self, key: str, now: float) -> int:
        # expired leases (a crashed process's) are not counted; `remove_lease` deletes them when a
        # request of the same key settles
        return self.c.execute(
            "SELECT count(*) FROM leases WHERE key = ? AND expires_at > ?", (key, now)
        ).fetchone()[0]

    def add_lease(self, key: str, lease_id: str, expires_at: float) -> None:
        self.c.execute("INSERT OR REPLACE INTO leases VALUES (?, ?, ?)", (key, lease_id, expires_at))

    def remove_lease(self, key: str, lease_id: str, now: float) -> None:
        # the key's expired leases go too: `lease_count` skips them, this keeps the table small
        self.c.execute(
            "DELETE FROM leases WHERE key = ? AND (lease_id = ? OR expires_at <= ?)", (key, lease_id, now)
        )

    def get_counters(self, keys: list[str]) -> list[int]:
        found = dict(self.c.execute(select_in("key, used", "counters", len(keys)), keys).fetchall())
        return [found.get(key, 0) for key in keys]

    def add_counters(self, rows: list[tuple[str, int, float]]) -> None:
        self.c.executemany(
            "INSERT INTO counters (key, used, expires_at) VALUES (?1, max(0, ?2), ?3) "
            "ON CONFLICT (key) DO UPDATE SET used = max(0, used + ?2), expires_at = excluded.expires_at",
            rows,
        )

    def add_usage(self, rows: list[UsageDelta]) -> None:
        keyed = [(u.tenant, u.key_id, u.model, u.deployment, u.period, u.requests, u.tokens, u.cost_micros) for u in rows if u.key_id is not None]  # fmt: skip
        if keyed:
            self.c.executemany(
                "INSERT INTO key_usage VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (tenant, key_id, model, deployment, period) DO UPDATE SET "
                "requests = requests + excluded.requests, tokens = tokens + excluded.tokens, "
                "cost_micros = cost_micros + excluded.cost_micros",
                keyed,
            )
            rows = [u for u in rows if u.key_id is None]
        self.c.executemany(
            "INSERT INTO usage (tenant, model, period, requests, tokens, cost_micros) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT (tenant, model, period) DO UPDATE SET requests = requests + excluded.requests, "
            "tokens = tokens + excluded.tokens, cost_micros = cost_micros + excluded.cost_micros",
            [(u.tenant, u.model, u.period, u.requests, u.tokens, u.cost_micros) for u in rows],
        )

    def mark_settled(self, settle_id: str, now: float) -> bool:
        cur = self.c.execute("INSERT OR IGNORE INTO settled (id, at) VALUES (?, ?)", (settle_id, now))
        return cur.rowcount == 1

    def put_journal(self, reservation_id: str, instance: str, payload: str) -> None:
        self.c.execute("INSERT OR REPLACE INTO journal VALUES (?, ?, ?)", (reservation_id, instance, payload))

    def drop_journal(self, reservation_id: str) -> None:
        self.c.execute("DELETE FROM journal WHERE id = ?", (reservation_id,))

    def put_mark(self, key: str, field: str, value: str) -> None:
        self.c.execute("INSERT OR REPLACE INTO marks VALUES (?, ?, ?)", (key, field, value))

    def get_mark(self, key: str, field: str) -> str | None:
        row = self.c.execute("SELECT value FROM marks WHERE key = ? AND field = ?", (key, field)).fetchone()
        return row[0] if row else None
