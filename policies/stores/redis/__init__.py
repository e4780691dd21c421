"""`redis://host:port/db`: state shared by several gateway replicas.

Every check-and-update is one Lua script (see `lua.py`), so limits do not multiply by the number
of replicas and no Python-side lock is involved. `redis` is imported only when this store is opened.
The URL may carry `?prefix=...` (default `fg:`) to share one Redis database between deployments.

The package: `store` (`RedisStore`, the StateStore operations), `pipeline` (scripts queued while
a round trip is out, sent together on the sender's own connection), `lua` (the scripts).
"""

from __future__ import annotations

from policies.stores.redis.store import RedisStore

__all__ = ["RedisStore"]
