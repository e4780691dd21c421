"""Consistent bucketing for weighted splits.

A caller's sticky key hashes to a fixed point in [0, 1). Routes own consecutive slices of that
interval, sized by weight, in the order the config lists them. Changing 90/10 to 80/20 therefore
moves only the callers whose point lies in the slice that changed hands, never anyone else.
"""

from __future__ import annotations

import hashlib
import random

BUCKETS = 10_000


def bucket_of(model: str, sticky_key: str | None) -> int:
    """The caller's bucket in [0, BUCKETS); a random one when the caller has no sticky key."""
    if sticky_key is None:
        return random.randrange(BUCKETS)
    digest = hashlib.blake2b(f"{model}\x00{sticky_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def pick_weighted(weights: list[float], bucket: int) -> int:
    """Index of the route whose slice holds `bucket`; weights need not sum to anything."""
    total = sum(weights)
    if total <= 0:
        raise ValueError("no route has a positive weight")
    point = (bucket + 0.5) / BUCKETS * total
    edge = 0.0
    for index, weight in enumerate(weights):
        edge += weight
        if point < edge:
            return index
    return max(i for i, w in enumerate(weights) if w > 0)


def rebucket(bucket: int) -> int:
    """A second, independent bucket derived from `bucket`.

    Used when a caller's own slice cannot serve (rolled-back canary, open circuit): the caller is
    spread over the remaining routes by this bucket, so the callers of every other slice stay put.
    """
    digest = hashlib.blake2b(bucket.to_bytes(4, "big"), digest_size=8, person=b"rebucket").digest()
    return int.from_bytes(digest, "big") % BUCKETS
