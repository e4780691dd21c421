"""`sqlite:///path`: the embedded default, durable and shared by every process on one host.

Group commit: every operation (acquire, settle, a key lookup...) is queued, and all operations queued
at that moment run in one `BEGIN IMMEDIATE` transaction, each inside its own savepoint (a failing
operation undoes only its own writes), then commit once and are answered. Requests arriving while a
group commits form the next group, so under load many requests share one commit, one thread hop and
one wake-up of the event loop. An operation is answered only after its group has committed, so what
a caller was told survives a crash exactly as before.

Where a group commits: with the default `synchronous=normal` a WAL commit is a write to the page
cache, tens of microseconds, cheaper than handing the group to a thread and waking the event loop
back (a `perf` profile of the proxy path at one request in flight put a tenth of the gateway's CPU
in those cross-thread wake-ups). So a group of one operation (nothing queued beside it) commits on
the event loop itself, on a second connection that never waits for a lock; it is scheduled with
`call_soon`, so what other callbacks ready at that moment queue joins it. A larger group means
requests overlap, and a loop that took over `_LOOP_BUSY_S` to reach the group is busy with other
requests: either way the group goes to the store's own thread and connection, whose SQLite work
then runs beside the loop (SQLite releases the GIL), and what queues meanwhile forms the thread's
next group. When another process holds the write lock (two workers or replicas on one file), the
loop's connection is refused at once and the group goes to the thread too, whose connection waits
up to the busy timeout: the loop never blocks on a lock. The loop's connection never checkpoints
the WAL on commit (a checkpoint writes the database file and syncs); the thread runs a passive
checkpoint after every `_CHECKPOINT_EVERY` groups committed on the loop. `?synchronous=full` (an
fsync per commit) and `?commit=thread` keep every group on the thread. `bench/bench_policy_proxy.py`
measures the default against `?commit=thread`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar
from urllib.parse import parse_qs

from policies.errors import StoreUnavailable
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
    from_epoch,
    to_epoch,
)
from policies.types import KeyRecord, UsageRow

T = TypeVar("T")

#: groups committed on the event loop between two passive WAL checkpoints on the store's thread
_CHECKPOINT_EVERY = 500
#: a loop that took longer than this to reach a scheduled group is busy with other requests: the
#: group goes to the thread, so its SQLite work runs beside the loop instead of on it
_LOOP_BUSY_S = 100e-6

# State tables are WITHOUT ROWID: a table keyed by text is then one B-tree instead of a table and an
# index, so a request's two commits write ~4.6 WAL pages each instead of ~7.1 (measured). Files made
# before keep their rowid tables (CREATE ... IF NOT EXISTS), which the same statements serve.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS buckets (key TEXT PRIMARY KEY, level REAL NOT NULL, ts REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS leases (key TEXT NOT NULL, lease_id TEXT NOT NULL, expires_at REAL NOT NULL,
    PRIMARY KEY (key, lease_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS counters (key TEXT PRIMARY KEY, used INTEGER NOT NULL, expires_at REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS usage (tenant TEXT NOT NULL, model TEXT NOT NULL, period TEXT NOT NULL,
    requests INTEGER NOT NULL, tokens INTEGER NOT NULL, PRIMARY KEY (tenant, model, period)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS settled (id TEXT PRIMARY KEY, at REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS journal (id TEXT PRIMARY KEY, instance TEXT NOT NULL, payload TEXT NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS instances (id TEXT PRIMARY KEY, expires_at REAL NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS keys (key_id TEXT PRIMARY KEY, tenant TEXT NOT NULL, hash TEXT NOT NULL,
    models TEXT NOT NULL, name TEXT, created_at REAL NOT NULL, expires_at REAL, revoked_at REAL,
    last_used_at REAL);
CREATE TABLE IF NOT EXISTS records (kind TEXT NOT NULL, id TEXT NOT NULL, tenant TEXT NOT NULL,
    created_at REAL NOT NULL, body TEXT NOT NULL, PRIMARY KEY (kind, id));
CREATE INDEX IF NOT EXISTS records_by_tenant ON records (kind, tenant, created_at, id);
CREATE TABLE IF NOT EXISTS marks (key TEXT NOT NULL, field TEXT NOT NULL, value TEXT NOT NULL,
    PRIMARY KEY (key, field)) WITHOUT ROWID;
"""
_KEY_COLUMNS = "key_id, tenant, models, name, created_at, expires_at, revoked_at, last_used_at"


@functools.cache
def _select_in(columns: str, table: str, n: int) -> str:
    """`SELECT columns FROM table WHERE key IN (?, ...)` with n placeholders (one text per n, cached)."""
    return f"SELECT {columns} FROM {table} WHERE key IN ({', '.join('?' * n)})"  # noqa: S608 - fixed names


class _SqliteTxn:
    """The `_engine.Txn` view of one open SQLite transaction."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.c = conn

    def get_buckets(self, keys: list[str]) -> list[tuple[float, float] | None]:
        found = {key: (level, ts) for key, level, ts in self.c.execute(_select_in("key, level, ts", "buckets", len(keys)), keys)}  # fmt: skip
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
        found = dict(self.c.execute(_select_in("key, used", "counters", len(keys)), keys).fetchall())
        return [found.get(key, 0) for key in keys]

    def add_counters(self, rows: list[tuple[str, int, float]]) -> None:
        self.c.executemany(
            "INSERT INTO counters (key, used, expires_at) VALUES (?1, max(0, ?2), ?3) "
            "ON CONFLICT (key) DO UPDATE SET used = max(0, used + ?2), expires_at = excluded.expires_at",
            rows,
        )

    def add_usage(self, rows: list[UsageDelta]) -> None:
        self.c.executemany(
            "INSERT INTO usage VALUES (?, ?, ?, ?, ?) ON CONFLICT (tenant, model, period) DO UPDATE SET "
            "requests = requests + excluded.requests, tokens = tokens + excluded.tokens",
            [(u.tenant, u.model, u.period, u.requests, u.tokens) for u in rows],
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


def _answer_all(answers: list[tuple[asyncio.Future, bool, object]]) -> None:
    """On a caller's loop: hand each operation of a committed group its result or error."""
    for future, ok, value in answers:
        if future.done():  # its caller was cancelled; the operation committed all the same
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)  # type: ignore[arg-type]


def _rollback(conn: sqlite3.Connection) -> None:
    """End a failed transaction; a connection that cannot even roll back is past caring."""
    try:
        conn.execute("ROLLBACK")
    except sqlite3.Error:
        pass


def _store_error(path: str, exc: Exception) -> Exception:
    """A database error of one operation becomes StoreUnavailable; anything else stays itself."""
    if isinstance(exc, sqlite3.OperationalError | sqlite3.DatabaseError):
        return StoreUnavailable(f"sqlite {path}: {exc}")
    return exc


def _key_from_row(row: tuple) -> KeyRecord:
    key_id, tenant, models, name, created_at, expires_at, revoked_at, last_used_at = row
    return KeyRecord(
        key_id=key_id,
        tenant=tenant,
        models=json.loads(models),
        name=name,
        created_at=from_epoch(created_at),
        expires_at=from_epoch(expires_at),
        revoked_at=from_epoch(revoked_at),
        last_used_at=from_epoch(last_used_at),
    )


def _add_missing_columns(conn: sqlite3.Connection) -> None:
    """Bring a file made by an older release up to this schema (columns are only ever added)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(keys)")}
    if "last_used_at" not in columns:
        conn.execute("ALTER TABLE keys ADD COLUMN last_used_at REAL")


class SqliteStore(StateStore):
    """State in one SQLite file (WAL), used through a single dedicated thread."""

    def __init__(self, path: str, *, synchronous: str = "NORMAL", busy_timeout_ms: int = 5000) -> None:
        self.path = path
        self._synchronous = synchronous.upper()
        if self._synchronous not in ("NORMAL", "FULL", "EXTRA"):
            raise ValueError(f"sqlite synchronous must be normal, full or extra, got {synchronous!r}")
        self._busy_timeout_ms = busy_timeout_ms
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fg-sqlite")
        self._conn: sqlite3.Connection | None = None
        #: the event loop's own connection (busy timeout 0), None where groups always go to the thread
        self._loop_conn: sqlite3.Connection | None = None
        self._scheduled_at = 0.0  # when the pending drain was scheduled on the loop
        self._ops = 0
        #: operations waiting for the next group: (work, the caller's future, the caller's loop)
        self._queued: list[
            tuple[Callable[[sqlite3.Connection], object], asyncio.Future, asyncio.AbstractEventLoop]
        ] = []
        self._queue_lock = threading.Lock()
        #: a drain of the queue is scheduled or running on the thread
        self._draining = False
        self._closed = False
        #: groups committed and operations they held (bench and tests read these)
        self.groups = 0
        self.grouped_ops = 0
        #: of those groups, the ones committed on the event loop (bench and tests read this)
        self.loop_groups = 0

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

    def _open_loop_connection(self) -> sqlite3.Connection:
        """The connection groups commit on when they run on the event loop: it never waits.

        `check_same_thread` is off because a store may serve several loops (tests do); only one
        drain runs at a time (`_draining`), so the connection is never used by two threads at once.
        """
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=0, check_same_thread=False)
        conn.execute("PRAGMA busy_timeout = 0")
        conn.execute(f"PRAGMA synchronous = {self._synchronous}")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        return conn

    def _connect(self) -> None:
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=self._busy_timeout_ms / 1000)
        conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
        # Switching a new file to WAL takes an exclusive lock without waiting on the busy timeout:
        # two processes opening the same new file at once retry instead of failing.
        for attempt in range(50):
            try:
                conn.execute("PRAGMA journal_mode = WAL")
                conn.execute(f"PRAGMA synchronous = {self._synchronous}")
                conn.executescript(_SCHEMA)
                _add_missing_columns(conn)
                break
            except sqlite3.OperationalError:
                if attempt == 49:
                    raise
                time.sleep(0.02)
        self._conn = conn

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise sqlite3.OperationalError("store is closed")
        return self._conn

    async def _run(self, fn: Callable[[], T]) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn)
        except (sqlite3.OperationalError, sqlite3.DatabaseError) as exc:
            raise StoreUnavailable(f"sqlite {self.path}: {exc}") from exc
        except RuntimeError as exc:  # executor shut down: the store was closed
            raise StoreUnavailable(f"sqlite {self.path}: closed") from exc

    async def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn` in the next group's transaction; returns once that group has committed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._queue_lock:
            if self._closed:
                raise StoreUnavailable(f"sqlite {self.path}: closed")
            self._queued.append((fn, future, loop))
            start = not self._draining
            self._draining = True
            if start:  # under the lock: close() cannot shut the executor down in between
                if self._loop_conn is not None:
                    self._scheduled_at = time.perf_counter()
                    loop.call_soon(self._drain_on_loop)  # after the callbacks ready now have queued theirs
                else:
                    self._executor.submit(self._drain)
        return await future

    def _drain_on_loop(self) -> None:
        """On the event loop: commit the queued group on the loop's connection, or hand it to the thread."""
        with self._queue_lock:
            group, self._queued = self._queued, []
            if not group:
                self._draining = False
                return
        conn = self._loop_conn
        outcomes = None
        if conn is not None and len(group) == 1 and time.perf_counter() - self._scheduled_at <= _LOOP_BUSY_S:
            outcomes = self._commit_on(conn, [fn for fn, _, _ in group])
        if not isinstance(outcomes, list):  # overlap, a busy loop, the lock held elsewhere, or closed
            with self._queue_lock:
                self._queued[:0] = group  # first in line on the thread, which waits for the lock
                try:
                    self._executor.submit(self._drain)
                    return
                except RuntimeError:  # the executor is shut down: the store was closed
                    group, self._queued, self._draining = self._queued, [], False
            self._answer(group, [(False, StoreUnavailable(f"sqlite {self.path}: closed"))] * len(group))
            return
        self.loop_groups += 1
        here = asyncio.get_running_loop()
        self._answer(group, outcomes, here)
        with self._queue_lock:
            if self._queued:  # queued from another thread while this group committed
                self._scheduled_at = time.perf_counter()
                here.call_soon(self._drain_on_loop)
            else:
                self._draining = False
        if self.loop_groups % _CHECKPOINT_EVERY == 0:
            try:
                self._executor.submit(self._checkpoint)
            except RuntimeError:  # closed meanwhile (from another thread): nothing left to checkpoint
                pass

    def _commit_on(
        self, conn: sqlite3.Connection, group: list[Callable[[sqlite3.Connection], object]]
    ) -> list[tuple[bool, object]] | sqlite3.Error:
        """The group in one transaction on `conn`: each operation's outcome, or why it could not begin.

        `BEGIN IMMEDIATE` takes the write lock before reading (check-and-set). On the loop's
        connection (busy timeout 0) it fails at once while another process holds the lock.
        """
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.Error as exc:
            return exc
        try:
            return self._run_group(conn, group)
        except Exception as exc:  # noqa: BLE001 - e.g. InterfaceError: the group fails, the store lives
            if conn.in_transaction:
                _rollback(conn)
            return [(False, StoreUnavailable(f"sqlite {self.path}: {type(exc).__name__}"))] * len(group)

    def _checkpoint(self) -> None:
        """On the store's thread: copy committed WAL pages into the database without blocking writers."""
        conn = self._conn
        if conn is None:
            return
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error:  # busy or closing: the next checkpoint catches up
            pass

    def _drain(self) -> None:
        """On the store's thread: commit groups until the queue is empty.

        Whatever happens, every queued caller is answered and the next operation starts a drain
        again (an unanswered group would make every later call wait forever).
        """
        group: list = []
        try:
            while True:
                with self._queue_lock:
                    group, self._queued = self._queued, []
                    if not group:
                        self._draining = False
                        return
                self._answer(group, self._commit_group_safely([fn for fn, _, _ in group]))
                group = []
        except BaseException as exc:
            with self._queue_lock:
                group, self._queued, self._draining = group + self._queued, [], False
            error = StoreUnavailable(f"sqlite {self.path}: {type(exc).__name__}")
            self._answer(group, [(False, error)] * len(group))
            raise

    def _commit_group_safely(
        self, group: list[Callable[[sqlite3.Connection], object]]
    ) -> list[tuple[bool, object]]:
        """On the store's thread: the group on the thread's connection, every failure an outcome."""
        try:
            outcomes = self._commit_on(self._connection(), group)
        except sqlite3.Error as exc:  # the store is closed
            outcomes = exc
        if isinstance(outcomes, list):
            return outcomes
        return [(False, StoreUnavailable(f"sqlite {self.path}: {outcomes}"))] * len(group)

    def _answer(
        self, group: list, outcomes: list[tuple[bool, object]], here: asyncio.AbstractEventLoop | None = None
    ) -> None:
        """Hand each operation of a group its outcome on its caller's loop: at once on `here` (the
        loop this runs on), through `call_soon_threadsafe` (a wake-up) on any other."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, bool, object]]] = {}
        for (_, future, loop), (ok, value) in zip(group, outcomes, strict=True):
            by_loop.setdefault(loop, []).append((future, ok, value))
        for loop, answers in by_loop.items():
            if loop is here:
                _answer_all(answers)
                continue
            try:
                loop.call_soon_threadsafe(_answer_all, answers)
            except RuntimeError:  # that loop is closed: nobody is waiting any more
                pass

    def _run_group(
        self, conn: sqlite3.Connection, group: list[Callable[[sqlite3.Connection], object]]
    ) -> list[tuple[bool, object]]:
        """Inside a transaction `conn` began: each operation in its savepoint, then one commit.

        A group of one needs no savepoint (two statements of the few a request costs): its
        failure rolls the whole transaction back.
        """
        if len(group) == 1:
            return self._run_alone(conn, group[0])
        outcomes: list[tuple[bool, object]] = []
        try:
            for fn in group:
                conn.execute("SAVEPOINT op")
                try:
                    outcomes.append((True, fn(conn)))
                except Exception as exc:  # noqa: BLE001 - this operation's own failure
                    conn.execute("ROLLBACK TO op")
                    outcomes.append((False, _store_error(self.path, exc)))
                conn.execute("RELEASE op")
        except (sqlite3.OperationalError, sqlite3.DatabaseError) as exc:
            _rollback(conn)
            return [(False, StoreUnavailable(f"sqlite {self.path}: {exc}"))] * len(group)
        return self._commit(conn, outcomes)

    def _run_alone(
        self, conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], object]
    ) -> list[tuple[bool, object]]:
        """A group of one operation: its own transaction, committed or rolled back whole."""
        try:
            value = fn(conn)
        except Exception as exc:  # noqa: BLE001 - the operation's own failure
            _rollback(conn)
            return [(False, _store_error(self.path, exc))]
        return self._commit(conn, [(True, value)])

    def _commit(
        self, conn: sqlite3.Connection, outcomes: list[tuple[bool, object]]
    ) -> list[tuple[bool, object]]:
        """Commit the group's transaction: its outcomes stand, or every operation gets the error."""
        try:
            conn.execute("COMMIT")
        except (sqlite3.OperationalError, sqlite3.DatabaseError) as exc:
            _rollback(conn)
            return [(False, StoreUnavailable(f"sqlite {self.path}: {exc}"))] * len(outcomes)
        self.groups += 1
        self.grouped_ops += len(outcomes)
        return outcomes

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
    ) -> AcquireResult:
        return await self._tx(
            lambda c: _engine.acquire(
                _SqliteTxn(c),
                lease_id=lease_id,
                lease_ttl_s=lease_ttl_s,
                buckets=buckets,
                leases=leases,
                counters=counters,
                now=now,
                journal=journal,
            )
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
        self._ops += 1
        gc = self._ops % 1024 == 0

        def run(c: sqlite3.Connection) -> bool:
            if gc:  # forget old settle ids and counters of past periods now and then
                c.execute("DELETE FROM settled WHERE at < ?", (now - SETTLE_MEMORY_S,))
                c.execute("DELETE FROM counters WHERE expires_at < ?", (now,))
            return _engine.settle(
                _SqliteTxn(c),
                settle_id=settle_id,
                lease_id=lease_id,
                buckets=buckets,
                release=release,
                counters=counters,
                usage=usage,
                now=now,
                marks=marks,
            )

        return await self._tx(run)

    async def renew(self, *, lease_id: str, keys: list[str], ttl_s: float, now: float) -> None:
        expires_at = now + ttl_s

        def run(c: sqlite3.Connection) -> None:
            for key in keys:
                c.execute(
                    "UPDATE leases SET expires_at = ? WHERE key = ? AND lease_id = ?",
                    (expires_at, key, lease_id),
                )

        await self._tx(run)

    async def usage(self, tenant: str | None = None) -> list[UsageRow]:
        def run(c: sqlite3.Connection) -> list[tuple]:
            sql = "SELECT tenant, model, period, requests, tokens FROM usage"
            if tenant is None:
                return c.execute(sql + " ORDER BY 1, 2, 3").fetchall()
            return c.execute(sql + " WHERE tenant = ? ORDER BY 1, 2, 3", (tenant,)).fetchall()

        rows = await self._tx(run)
        return [UsageRow(tenant=t, model=m, period=p, requests=r, tokens=k) for t, m, p, r, k in rows]

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
        )
        sql = (
            "INSERT OR IGNORE INTO keys (key_id, tenant, hash, models, name, created_at, expires_at, revoked_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
        )
        return await self._tx(lambda c: c.execute(sql, values).rowcount == 1)

    async def get_key(self, key_id: str) -> tuple[KeyRecord, str] | None:
        def run(c: sqlite3.Connection) -> tuple | None:
            sql = f"SELECT {_KEY_COLUMNS}, hash FROM keys WHERE key_id = ?"
            return c.execute(sql, (key_id,)).fetchone()

        # through the group like every operation: the store's one thread is never held by a
        # drain that a separate read would have to wait behind
        row = await self._tx(run)
        return None if row is None else (_key_from_row(row[:-1]), row[-1])

    async def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        def run(c: sqlite3.Connection) -> list[tuple]:
            sql = f"SELECT {_KEY_COLUMNS} FROM keys"
            if tenant is None:
                return c.execute(sql + " ORDER BY created_at, key_id").fetchall()
            return c.execute(sql + " WHERE tenant = ? ORDER BY created_at, key_id", (tenant,)).fetchall()

        return [_key_from_row(row) for row in await self._tx(run)]

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
            txn = _SqliteTxn(c)
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

    async def close(self) -> None:
        """Answer what is queued, then close; later operations raise StoreUnavailable."""
        with self._queue_lock:
            self._closed = True
        # a group scheduled on the loop or running on the thread is answered before its connection goes
        deadline = time.monotonic() + self._busy_timeout_ms / 1000 + 1.0
        while self._draining and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        if self._loop_conn is not None:
            self._loop_conn.close()
            self._loop_conn = None
        if self._conn is None:
            return

        def run() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await asyncio.get_running_loop().run_in_executor(self._executor, run)
        self._executor.shutdown(wait=True)
