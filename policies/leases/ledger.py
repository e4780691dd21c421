"""Settlements off the request: what admitted requests used, summed in memory and written in batches.

Each finished request adds its settle (token corrections of buckets and counters, refunds, usage rows)
here; `drain` turns what was added since the last drain into one store settle with its own id, so a
batch is applied at most once however often it is retried. Rows of the same key are summed: a batch
holds one row per bucket, counter and usage key, whatever the number of requests.
"""

from __future__ import annotations

from secrets import token_hex
from typing import Any

from policies.stores.base import BucketOp, CounterOp, UsageDelta


class Ledger:
    """Corrections and usage not yet written to the store."""

    def __init__(self, instance: str) -> None:
        # a batch's settle id: a prefix drawn at each start and a count, so a process started again
        # under the same instance name never sends an id the store has applied already (it would
        # take the new batch for that one and drop it)
        self._prefix = f"{instance}.batch.{token_hex(6)}."
        self._batches = 0
        #: key -> [capacity, rate_per_s, cost] of a bucket correction
        self._buckets: dict[str, list] = {}
        #: key -> [cost, expires_at] of a counter correction
        self._counters: dict[str, list] = {}
        #: (tenant, model, period, key_id, deployment) -> [requests, tokens, cost_micros]
        self._usage: dict[tuple[str, str, str, str | None, str], list[int]] = {}
        #: requests settled into the ledger since the last drain
        self.pending = 0

    def add(self, buckets: list[BucketOp], counters: list[CounterOp], usage: list[UsageDelta]) -> None:
        """Sum one request's settle into the next batch (limits are never checked at settle)."""
        self.pending += 1
        for b in buckets:
            sums = self._buckets.get(b.key)
            if sums is None:
                self._buckets[b.key] = [b.capacity, b.rate_per_s, b.cost]
            else:
                sums[2] += b.cost
        for c in counters:
            sums = self._counters.get(c.key)
            if sums is None:
                self._counters[c.key] = [c.cost, c.expires_at]
            else:
                sums[0] += c.cost
                sums[1] = max(sums[1], c.expires_at)
        for u in usage:
            key = (u.tenant, u.model, u.period, u.key_id, u.deployment)
            row = self._usage.get(key)
            if row is None:
                self._usage[key] = [u.requests, u.tokens, u.cost_micros]
            else:
                row[0] += u.requests
                row[1] += u.tokens
                row[2] += u.cost_micros

    def drain(self, now: float) -> dict[str, Any] | None:
        """The store settle of everything added since the last drain (None: nothing), emptied here."""
        if not (self._buckets or self._counters or self._usage):
            return None
        self._batches += 1
        batch_id = f"{self._prefix}{self._batches}"
        settle = dict(
            settle_id=batch_id,
            lease_id=batch_id,
            buckets=[BucketOp(k, capacity, rate, cost) for k, (capacity, rate, cost) in self._buckets.items() if cost],
            release=[],
            counters=[CounterOp(k, None, cost, expires) for k, (cost, expires) in self._counters.items() if cost],
            usage=[
                UsageDelta(tenant, model, period, requests, tokens, micros, key_id, deployment)
                for (tenant, model, period, key_id, deployment), (requests, tokens, micros) in self._usage.items()
            ],
            now=now,
        )
        self._buckets, self._counters, self._usage, self.pending = {}, {}, {}, 0
        return settle
