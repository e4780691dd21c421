"""Edge partition tolerance (`state.partition`): admitting beyond the slices while the store is cut off.

The only case where a limit can be exceeded: by at most `max_overspend_fraction` of each limit, for
at most `max_seconds`; what is admitted so is charged to the store with the next batch that reaches it.
"""

from __future__ import annotations

import math

from policies import ratelimit as rl
from policies.errors import StoreUnavailable
from policies.leases.ledger import Ledger
from policies.leases.metrics import PARTITION_ADMITS
from policies.leases.settings import PartitionSettings
from policies.leases.slices import SliceBook
from policies.leases.slots import SlotPool
from policies.stores.base import AcquireResult, BucketOp, BucketView, CounterOp


class PartitionTolerance:
    """The partition half of `LeasePath` (its state is set up there)."""

    partition: PartitionSettings | None
    down_since: float | None
    book: SliceBook
    ledger: Ledger
    overspent: dict[str, float]
    stats: dict[str, int]

    def limit(self, op: CounterOp) -> float:
        """A counter op's limit as a slice's limit (0: none)."""
        return float(op.limit or 0)

    def pool(self, cc: rl.ConcurrencyCheck) -> SlotPool:
        raise NotImplementedError

    def admit_partitioned(
        self,
        buckets: list[rl.RateCheck],
        conc: list[rl.ConcurrencyCheck],
        counters: list[CounterOp],
        lacking: list[int],
        now: float,
    ) -> tuple[AcquireResult, list[BucketView]]:
        """Admit beyond the slices, within `state.partition`'s bound, or raise StoreUnavailable."""
        p = self.partition
        if self.down_since is None:
            self.down_since = now
        if p is None or now - self.down_since > p.max_seconds:
            raise StoreUnavailable("the state store is unreachable and the slices held do not cover the request")
        extra: list[tuple[BucketOp | CounterOp, float, float]] = []  # (op, units beyond the slices, limit)
        for op, limit in [(b.op, b.op.capacity) for b in buckets] + [(c, self.limit(c)) for c in counters]:
            ks = self.book.keys.get(op.key)
            left = ks.left if ks is not None and ks.limit == limit else 0.0
            if left < op.cost:
                extra.append((op, op.cost - left, limit))
        over = [op.key for op, units, limit in extra if self.overspent.get(op.key, 0.0) + units > limit * p.max_overspend_fraction]  # fmt: skip
        pools = [self.pool(conc[i]) for i in lacking]
        over += [pool_key for pool_key, pool in zip([conc[i].op.key for i in lacking], pools, strict=True)
                 if pool.extra + 1 > math.floor(pool.limit * p.max_overspend_fraction)]  # fmt: skip
        if over:
            raise StoreUnavailable(f"the state store is unreachable and the partition bound is reached for {over[0]}")
        for op, units, _ in extra:
            self.overspent[op.key] = self.overspent.get(op.key, 0.0) + units
        for op, _, limit in [(b.op, 0, b.op.capacity) for b in buckets] + [(c, 0, self.limit(c)) for c in counters]:
            ks = self.book.keys.get(op.key)
            if ks is not None and ks.limit == limit:
                self.book.consume(op.key, min(ks.left, op.cost), now)
        # what was admitted beyond the slices is charged to the store when it answers again
        self.ledger.add(
            [BucketOp(op.key, op.capacity, op.rate_per_s, units) for op, units, _ in extra if isinstance(op, BucketOp)],
            [CounterOp(op.key, None, int(units), op.expires_at) for op, units, _ in extra if isinstance(op, CounterOp)],
            [],
        )  # fmt: skip
        self.ledger.pending -= 1  # a charge, not a request
        for pool in pools:
            pool.extra += 1
        self.stats["partition"] += 1
        PARTITION_ADMITS.inc()
        views = [BucketView(0.0, 0.0) for _ in buckets]
        return AcquireResult(True, views, [0 for _ in counters], []), views
