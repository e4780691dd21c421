"""Pipelining: a Redis store's scripts, queued while a round trip is out, sent together.

The scripts of admissions and settlements queued while a round trip is out are sent together as
one pipeline (each script still atomic on the server) on a connection the sender keeps for itself,
so under load many requests share one round trip and one wake-up instead of each holding a
connection. A script Redis forgot (a restart, a flush) is loaded again and its operations resent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from policies.errors import StoreUnavailable

T = TypeVar("T")


def _unavailable_errors() -> tuple[type[BaseException], ...]:
    from redis import exceptions as rex

    # Failures of the store itself; a ResponseError from a script is a bug and must surface as one.
    return (
        rex.ConnectionError,
        rex.TimeoutError,
        rex.BusyLoadingError,
        rex.ReadOnlyError,
        OSError,
        asyncio.TimeoutError,
    )


class ScriptPipeline:
    """One Redis client, the sender's own connection and the queue of scripts for the next
    pipeline: `_pipelined(script, keys, args)` runs a script, `_call(aw)` any other command, both
    turning the store's failures into StoreUnavailable. `RedisStore` builds its operations on it."""

    def __init__(self, client: Any, url: str, timeout_s: float = 2.0) -> None:
        self._client = client
        self._timeout_s = timeout_s
        #: the pipeline sender's own connection (see `_round_trip`), made on first use
        self._pipe_conn: Any = None
        parts = urlsplit(url)
        self._where = f"{parts.hostname}:{parts.port or 6379}{parts.path}"  # never the password
        self._errors = _unavailable_errors()
        #: scripts waiting for the next pipeline: (script, keys, args, the caller's future)
        self._queued: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]] = []
        self._sender: asyncio.Task[None] | None = None
        #: pipelines sent and scripts they held (bench and tests read these)
        self.pipelines = 0
        self.pipelined_ops = 0

    async def _call(self, aw: Awaitable[T]) -> T:
        try:
            return await aw
        except self._errors as exc:
            raise StoreUnavailable(f"redis {self._where}: {type(exc).__name__}") from exc

    async def _pipelined(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run `script` in the next pipeline; its result, or StoreUnavailable."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queued.append((script, keys, args, future))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_all(), name="redis-pipeline")
        return await future

    async def _send_all(self) -> None:
        """Send queued scripts as pipelines, one round trip at a time, until none are left.

        Every caller is answered whatever happens: should this task itself be cancelled (shutdown),
        the callers still waiting get StoreUnavailable instead of waiting forever.
        """
        reloaded: set[int] = set()  # scripts loaded again by this task: a second NOSCRIPT fails
        group: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]] = []
        try:
            while self._queued:
                group, self._queued = self._queued, []
                results = await self._send(group)
                missing = {id(s): s for (s, *_), r in zip(group, results, strict=True) if _no_script(r)}
                if missing and not reloaded & missing.keys():
                    # Redis was restarted or flushed: load the scripts, send those operations again
                    try:
                        for script in missing.values():
                            await self._client.script_load(script.script)
                        reloaded |= missing.keys()
                        self._queued[:0] = [op for op, r in zip(group, results, strict=True) if _no_script(r)]
                        results = [None if _no_script(r) else r for r in results]  # resent, not answered
                    except Exception as exc:  # noqa: BLE001
                        results = [self._failure(exc) if _no_script(r) else r for r in results]
                _answer_group(group, results, self._failure)
                group = []
        except BaseException:
            pending, self._queued = group + self._queued, []
            _answer_group(pending, [StoreUnavailable(f"redis {self._where}: interrupted")] * len(pending), self._failure)
            raise

    async def _send(self, group: list[tuple[Any, list[str], list[Any], asyncio.Future[Any]]]) -> list[Any]:
        commands = [("EVALSHA", script.sha, len(keys), *keys, *args) for script, keys, args, _ in group]
        try:
            results = await self._round_trip(commands)
        except Exception as exc:  # noqa: BLE001 - every caller of the group gets the failure
            results = [self._failure(exc)] * len(group)
        self.pipelines += 1
        self.pipelined_ops += len(group)
        return results

    async def _round_trip(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Every command sent at once and every reply read, an error reply in its command's place
        (as redis-py's `execute(raise_on_error=False)`), on the sender's own connection.

        Own, because `_send_all` has one round trip out at a time: no pool checkout, health probe
        and release per round trip, and one timeout over the exchange instead of one per socket
        read: about 480 us less CPU a Redis-backed chat request than redis-py's Pipeline
        (`bench/bench_hot_path_inprocess.py`, the `redis` change). A connection that failed is
        dropped; after a refused or broken connection the round trip is tried once more on a new
        one, as redis-py retries. A timeout is not retried: the scripts may have run, and
        admissions fail closed instead.
        """
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import ResponseError

        for attempt in (0, 1):
            conn = self._pipeline_connection()
            try:
                async with asyncio.timeout(self._timeout_s):
                    await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
                    results: list[Any] = []
                    for _ in commands:
                        try:
                            results.append(await conn.read_response())
                        except ResponseError as exc:  # this script's own error (NOSCRIPT, a bug)
                            results.append(exc)
                    return results
            except (RedisConnectionError, ConnectionError):
                await conn.disconnect()
                if attempt:
                    raise
            except BaseException:
                await conn.disconnect()  # replies may be left unread: the connection cannot be reused
                raise
        raise AssertionError("unreachable")

    def _pipeline_connection(self) -> Any:
        if self._pipe_conn is None:
            pool = self._client.connection_pool
            # no per-read socket timeout: `_round_trip` bounds the whole exchange
            self._pipe_conn = pool.connection_class(**{**pool.connection_kwargs, "socket_timeout": None})
        return self._pipe_conn

    def _failure(self, exc: Exception) -> Exception:
        """A store failure (or a script error, which fails closed too) as StoreUnavailable."""
        if isinstance(exc, StoreUnavailable):
            return exc
        return StoreUnavailable(f"redis {self._where}: {type(exc).__name__}: {str(exc)[:200]}")

    async def close(self) -> None:
        if self._pipe_conn is not None:
            await self._pipe_conn.disconnect()
        await self._client.aclose()


def _answer_group(group: list, results: list[Any], failure: Any) -> None:
    """Hand each pipelined operation its result (None: it was queued again, not answered yet)."""
    for (_, _, _, future), result in zip(group, results, strict=True):
        if future.done() or result is None:  # its caller went away, or it is being resent
            continue
        if isinstance(result, BaseException):
            future.set_exception(failure(result))
        else:
            future.set_result(result)


def _no_script(result: object) -> bool:
    """Whether a pipelined EVALSHA failed because Redis does not hold the script (NOSCRIPT)."""
    return type(result).__name__ == "NoScriptError"  # redis.exceptions, imported only when used
