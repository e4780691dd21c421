"""State stores behind one small async interface, chosen by the `state.url` of the config.

- `memory://` — this process only (tests, one process); lost on exit.
- `sqlite:///relative/path.db` or `sqlite:////absolute/path.db` — embedded default, durable (WAL);
  `?synchronous=full` also survives a power loss.
- `redis://[:password@]host:port/db[?prefix=fg:]` — several replicas; every update one Lua script.
"""

from __future__ import annotations

from policies.stores.base import (
    AcquireResult,
    BucketOp,
    BucketView,
    CounterOp,
    Denial,
    LeaseOp,
    StateStore,
    UsageDelta,
)

__all__ = [
    "AcquireResult",
    "BucketOp",
    "BucketView",
    "CounterOp",
    "Denial",
    "LeaseOp",
    "StateStore",
    "UsageDelta",
    "open_store",
]


async def open_store(url: str) -> StateStore:
    """Open the store named by `url`.

    Raises:
        ValueError: the URL's scheme is not memory, sqlite or redis, or it is malformed.
        StoreUnavailable: the store cannot be reached (sqlite file not writable, redis down).
    """
    if url == "memory://" or url.startswith("memory://"):
        from policies.stores.memory import MemoryStore

        return MemoryStore()
    if url.startswith("sqlite:///"):
        from policies.stores.sqlite import SqliteStore

        return await SqliteStore.open(url)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from policies.stores.redis import RedisStore

        return await RedisStore.open(url)
    scheme = url.split(":", 1)[0] if ":" in url else url
    raise ValueError(f"state.url must start with memory://, sqlite:/// or redis://, got scheme {scheme!r}")
