"""Rate-limit checks (requests/min, tokens/min, concurrency) and the OpenAI-style headers.

Each configured limit becomes one store op: a token bucket of `limit` units refilling `limit` per
60 s, or a concurrency lease. Both the tenant's limits and the key's own limits apply.
"""

from __future__ import annotations

import math

from policies.stores.base import BucketOp, BucketView, LeaseOp
from policies.types import Limits

WINDOW_S = 60.0


class RateCheck:
    """One configured bucket limit: who it applies to (`scope`), what it counts, its store op."""

    __slots__ = ("scope", "name", "limit", "unit", "op")

    def __init__(self, scope: str, name: str, limit: int, unit: str, op: BucketOp) -> None:
        self.scope = scope  # "tenant acme" or "key 0a1b2c3d4e5f"
        self.name = name  # "requests_per_minute" | "tokens_per_minute"
        self.limit = limit
        self.unit = unit  # "requests" | "tokens"
        self.op = op

    def with_cost(self, cost: float) -> BucketOp:
        """The same bucket with another cost (a refund is negative)."""
        return BucketOp(self.op.key, self.op.capacity, self.op.rate_per_s, cost)

    def costing(self, cost: float) -> RateCheck:
        """This check for a request taking `cost` units."""
        return RateCheck(self.scope, self.name, self.limit, self.unit, self.with_cost(float(cost)))


class ConcurrencyCheck:
    """One configured max_concurrency limit and its lease op."""

    __slots__ = ("scope", "limit", "op")

    def __init__(self, scope: str, limit: int, op: LeaseOp) -> None:
        self.scope = scope
        self.limit = limit
        self.op = op


def rate_checks(
    scope: str, key: str, limits: Limits | None, cost_tokens: int
) -> tuple[list[RateCheck], list[ConcurrencyCheck]]:
    """The bucket and concurrency checks of one set of limits (`key` names it in the store)."""
    if limits is None:
        return [], []
    buckets = []
    if limits.requests_per_minute is not None:
        n = limits.requests_per_minute
        op = BucketOp(f"rl:{key}:rpm", float(n), n / WINDOW_S, 1.0)
        buckets.append(RateCheck(scope, "requests_per_minute", n, "requests", op))
    if limits.tokens_per_minute is not None:
        n = limits.tokens_per_minute
        op = BucketOp(f"rl:{key}:tpm", float(n), n / WINDOW_S, float(cost_tokens))
        buckets.append(RateCheck(scope, "tokens_per_minute", n, "tokens", op))
    leases = []
    if limits.max_concurrency is not None:
        leases.append(
            ConcurrencyCheck(scope, limits.max_concurrency, LeaseOp(f"cc:{key}", limits.max_concurrency))
        )
    return buckets, leases


def format_duration(seconds: float) -> str:
    """A duration the way OpenAI writes x-ratelimit-reset-*: "20ms", "1.5s", "6m0s"."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


def ratelimit_headers(checks: list[RateCheck], views: list[BucketView]) -> dict[str, str]:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} from the tightest bucket of each unit
    (least remaining, then the longest reset; the first of equals), found in one pass: every
    admitted request asks."""
    tightest: dict[str, tuple[RateCheck, BucketView]] = {}
    for check, view in zip(checks, views, strict=True):
        best = tightest.get(check.unit)
        if best is None or (view.remaining, -view.reset_s) < (best[1].remaining, -best[1].reset_s):
            tightest[check.unit] = (check, view)
    headers: dict[str, str] = {}
    for unit in ("requests", "tokens"):
        pair = tightest.get(unit)
        if pair is None:
            continue
        check, view = pair
        headers[f"x-ratelimit-limit-{unit}"] = str(check.limit)
        headers[f"x-ratelimit-remaining-{unit}"] = str(int(view.remaining))
        headers[f"x-ratelimit-reset-{unit}"] = format_duration(view.reset_s)
    return headers
