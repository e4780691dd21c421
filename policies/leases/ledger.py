"""Settlements off the request: what admitted requests used, summed in memory and written in batches.

Each finished request adds its settle (token corrections of buckets and counters, refunds, usage rows)
here; `drain` turns what was added since the last drain into one store settle with its own id, so a
batch is applied at most once however often it is retried. Rows of the same key are summed: a batch
holds one row per bucket, counter and usage key, whatever the number of requests.
"""

from __future__ import annotations

from typing import Any

import msgspec

from policies.stores.base import BucketOp, CounterOp, UsageDelta


class Ledger:
    """Corrections and usage not yet written to the store."""

    def __init__(self, instance: str) -> None:
        self._instance = instance
        self._batches = 0
        self._buckets: dict[str, BucketOp] = {}
        self._counters: dict[str, CounterOp] = {}
        self._usage: dict[UsageDelta, UsageDelta] = {}
        #: requests settled into the ledger since the last drain
        self.pending = 0

    def add(self, buckets: list[BucketOp], counters: list[CounterOp], usage: list[UsageDelta]) -> None:
        """Sum one request's settle into the next batch (limits are never checked at settle)."""
        self.pending += 1
        for b in buckets:
            old = self._buckets.get(b.key)
            self._buckets[b.key] = b if old is None else BucketOp(b.key, b.capacity, b.rate_per_s, old.cost + b.cost)
        for c in counters:
            old_c = self._counters.get(c.key)
            cost = c.cost if old_c is None else old_c.cost + c.cost
            self._counters[c.key] = CounterOp(c.key, None, cost, max(c.expires_at, old_c.expires_at if old_c else 0.0))
        for u in usage:
            row = msgspec.structs.replace(u, requests=0, tokens=0, cost_micros=0)
            old_u = self._usage.get(row)
            self._usage[row] = u if old_u is None else msgspec.structs.replace(
                u,
                requests=old_u.requests + u.requests,
                tokens=old_u.tokens + u.tokens,
                cost_micros=old_u.cost_micros + u.cost_micros,
            )

    def drain(self, now: float) -> dict[str, Any] | None:
        """The store settle of everything added since the last drain (None: nothing), emptied here."""
        if not (self._buckets or self._counters or self._usage):
            return None
        self._batches += 1
        batch_id = f"{self._instance}.batch.{self._batches}"
        settle = dict(
            settle_id=batch_id,
            lease_id=batch_id,
            buckets=[b for b in self._buckets.values() if b.cost],
            release=[],
            counters=[c for c in self._counters.values() if c.cost],
            usage=list(self._usage.values()),
            now=now,
        )
        self._buckets, self._counters, self._usage, self.pending = {}, {}, {}, 0
        return settle
