"""Group commit: the SQLite connections of a store, and how queued operations share one commit.

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
checkpoint after every `_CHECKPOINT_EVERY` groups committed on the loop. An urgent operation (its
caller holds others waiting: the lease path's top-up lock) commits at once on the loop's connection
when nothing is queued or committing, with no wait for a group (docs/state.md: on a busy loop a
queued group took a lease tick about 9 ms). `?synchronous=full` (an fsync per commit) and
`?commit=thread` keep every group on the thread. `bench/bench_policy_proxy.py`
measures the default against `?commit=thread`.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from policies.errors import StoreUnavailable
from policies.stores.sqlite.schema import SCHEMA, add_missing_columns

T = TypeVar("T")

#: groups committed on the event loop between two passive WAL checkpoints on the store's thread
_CHECKPOINT_EVERY = 500
#: a loop that took longer than this to reach a scheduled group is busy with other requests: the
#: group goes to the thread, so its SQLite work runs beside the loop instead of on it
_LOOP_BUSY_S = 100e-6


class GroupCommit:
    """The connections of one SQLite file (WAL) and the group commit every operation runs through:
    `_tx(fn)` runs `fn` in the next group's transaction. `SqliteStore` builds its operations on it."""

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
                conn.executescript(SCHEMA)
                add_missing_columns(conn)
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

    async def _tx(self, fn: Callable[[sqlite3.Connection], T], *, urgent: bool = False) -> T:
        """Run `fn` in the next group's transaction; returns once that group has committed.

        `urgent`: the caller holds others waiting (the lease path's top-up lock), so `fn` commits at
        once on the loop's connection when nothing is queued or committing, with no wait for a group.
        """
        if urgent and self._loop_conn is not None:
            outcomes = self._commit_now_all([fn])
            if outcomes is not None:
                ok, value = outcomes[0]
                if ok:
                    return value  # type: ignore[return-value]
                raise value  # type: ignore[misc]
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
            self._to_thread(group)
            return
        here = asyncio.get_running_loop()
        self._answer(group, outcomes, here)
        self._committed_on_loop(here)

    def _to_thread(self, group: list) -> None:
        """`group` first in line on the store's thread (it waits for the lock); closed: all answered."""
        with self._queue_lock:
            self._queued[:0] = group
            try:
                self._executor.submit(self._drain)
                return
            except RuntimeError:  # the executor is shut down: the store was closed
                group, self._queued, self._draining = self._queued, [], False
        self._answer(group, [(False, StoreUnavailable(f"sqlite {self.path}: closed"))] * len(group))

    def _commit_now_all(
        self, group: list[Callable[[sqlite3.Connection], object]]
    ) -> list[tuple[bool, object]] | None:
        """On the event loop: `group` in one transaction on the loop's connection, now; each one's
        outcome. None when it must queue instead: a group is queued or committing (it goes first),
        or another process holds the write lock (the thread's connection waits for it)."""
        conn = self._loop_conn
        with self._queue_lock:
            if self._closed:
                raise StoreUnavailable(f"sqlite {self.path}: closed")
            if self._draining or conn is None:
                return None
            self._draining = True  # the loop's connection is ours until this commit is done
        outcomes = self._commit_on(conn, group)
        if not isinstance(outcomes, list):  # the lock is held elsewhere: queue, as any operation
            with self._queue_lock:
                waiting = bool(self._queued)  # queued from another thread meanwhile
                self._draining = waiting
            if waiting:
                self._to_thread([])
            return None
        self._committed_on_loop(asyncio.get_running_loop())
        return outcomes

    def _committed_on_loop(self, here: asyncio.AbstractEventLoop) -> None:
        """After a commit on the loop's connection: drain what queued meanwhile; checkpoint now and then."""
        self.loop_groups += 1
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
