"""The SQLite file's tables, how an older file is brought up to them, and the rows read back.

State tables are WITHOUT ROWID: a table keyed by text is then one B-tree instead of a table and an
index, so a request's two commits write ~4.6 WAL pages each instead of ~7.1 (measured). Files made
before keep their rowid tables (CREATE ... IF NOT EXISTS), which the same statements serve.
"""

from __future__ import annotations

import functools
import json
import sqlite3

from policies.stores.base import decode_key_policy, from_epoch
from policies.types import KeyRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS buckets (key TEXT PRIMARY KEY, level REAL NOT NULL, ts REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS leases (key TEXT NOT NULL, lease_id TEXT NOT NULL, expires_at REAL NOT NULL,
    PRIMARY KEY (key, lease_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters (key TEXT PRIMARY KEY, used INTEGER NOT NULL, expires_at REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS usage (tenant TEXT NOT NULL, model TEXT NOT NULL, period TEXT NOT NULL,
    requests INTEGER NOT NULL, tokens INTEGER NOT NULL, cost_micros INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, model, period)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS key_usage (tenant TEXT NOT NULL, key_id TEXT NOT NULL, model TEXT NOT NULL,
    deployment TEXT NOT NULL, period TEXT NOT NULL, requests INTEGER NOT NULL, tokens INTEGER NOT NULL,
    cost_micros INTEGER NOT NULL, PRIMARY KEY (tenant, key_id, model, deployment, period)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS settled (id TEXT PRIMARY KEY, at REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS journal (id TEXT PRIMARY KEY, instance TEXT NOT NULL, payload TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS instances (id TEXT PRIMARY KEY, expires_at REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS keys (key_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, hash TEXT NOT NULL,
    models TEXT NOT NULL, name TEXT, created_at REAL NOT NULL, expires_at REAL, revoked_at REAL,
    last_used_at REAL, policy TEXT);
CREATE TABLE IF NOT EXISTS records (kind TEXT NOT NULL, id TEXT NOT NULL, tenant TEXT NOT NULL,
    created_at REAL NOT NULL, body TEXT NOT NULL, PRIMARY KEY (kind, id));
CREATE INDEX IF NOT EXISTS records_by_tenant ON records (kind, tenant, created_at, id);
CREATE TABLE IF NOT EXISTS marks (key TEXT NOT NULL, field TEXT NOT NULL, value TEXT NOT NULL,
    PRIMARY KEY (key, field)) WITHOUT ROWID;
"""
KEY_COLUMNS = "key_id, tenant, models, name, created_at, expires_at, revoked_at, last_used_at, policy"


@functools.cache
def select_in(columns: str, table: str, n: int) -> str:
    """`SELECT columns FROM table WHERE key IN (?, ...)` with n placeholders (one text per n, cached)."""
    return f"SELECT {columns} FROM {table} WHERE key IN ({', '.join('?' * n)})"  # noqa: S608 - fixed names


def key_from_row(row: tuple) -> KeyRecord:
    key_id, tenant, models, name, created_at, expires_at, revoked_at, last_used_at, policy = row
    own = decode_key_policy(policy)
    return KeyRecord(
        key_id=key_id,
        tenant=tenant,
        models=json.loads(models),
        name=name,
        created_at=from_epoch(created_at),
        expires_at=from_epoch(expires_at),
        revoked_at=from_epoch(revoked_at),
        last_used_at=from_epoch(last_used_at),
        limits=own.limits,
        budget=own.budget,
    )


def add_missing_columns(conn: sqlite3.Connection) -> None:
    """Bring a file made by an older release up to this schema (columns are only ever added)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(keys)")}
    if "last_used_at" not in columns:
        conn.execute("ALTER TABLE keys ADD COLUMN last_used_at REAL")
    if "policy" not in columns:  # a key's own limits and budget (JSON)
        conn.execute("ALTER TABLE keys ADD COLUMN policy TEXT")
    if "cost_micros" not in {row[1] for row in conn.execute("PRAGMA table_info(usage)")}:
        conn.execute("ALTER TABLE usage ADD COLUMN cost_micros INTEGER NOT NULL DEFAULT 0")
