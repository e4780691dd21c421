"""Token-bucket arithmetic (the GCRA equivalent) shared by the memory and SQLite stores.

A bucket's state is the level used (`level`) at time `ts`; it drains at `rate_per_s` and holds
`capacity`. A request of `cost` fits when `level_now + cost <= capacity`. This is exact and smooth:
a limit of N per minute admits a burst of N at once, then one more every 60/N seconds; over any
interval of T seconds it admits at most N + N*T/60 (so N in a burst, at most 2N in a sliding minute,
and N per minute on average); a burst of any size never gets more than N. The Redis Lua script in `stores/redis/lua.py` mirrors these functions
line by line; the contract tests hold all stores to the same answers.
"""

from __future__ import annotations

import math

#: Units of slack when comparing a bucket level with its capacity (float drain arithmetic).
BUCKET_EPSILON = 1e-6


def drain(level: float, ts: float, rate_per_s: float, now: float) -> float:
    """The level at `now` of a bucket that was at `level` at `ts` (never below zero)."""
    elapsed = now - ts
    if elapsed < 0.0:  # a replica whose clock is behind: never refill backwards
        elapsed = 0.0
    return max(0.0, level - elapsed * rate_per_s)


def fits(level_now: float, capacity: float, cost: float) -> bool:
    """Whether `cost` more units fit in the bucket now."""
    return level_now + cost <= capacity + BUCKET_EPSILON


def retry_after(level_now: float, capacity: float, rate_per_s: float, cost: float) -> float | None:
    """Seconds until `cost` fits, or None when it never can (cost above the capacity)."""
    if cost > capacity + BUCKET_EPSILON:
        return None
    return max(0.0, (level_now + cost - capacity) / rate_per_s)


def remaining(level_now: float, capacity: float) -> float:
    """Whole units that still fit now."""
    return float(max(0, math.floor(capacity - level_now + BUCKET_EPSILON)))


def reset_s(level_now: float, rate_per_s: float) -> float:
    """Seconds until the bucket is full again (back to its initial state)."""
    return level_now / rate_per_s if rate_per_s > 0 else 0.0
