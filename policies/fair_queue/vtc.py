"""Weighted Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024).

Each tenant has a counter of the service it received divided by its weight. The backlogged tenant
with the smallest counter goes next. A tenant that becomes backlogged is lifted to the smallest
counter of the tenants already backlogged (or, when none is, to the counter of the tenant that
left the queue last), so time spent idle is not banked as credit: a returning tenant competes
from where the others are, and its lead over any backlogged tenant stays bounded by about one
request's cost per dispatch slot.

Bounded burst credit (`burst`, cost units; 0 is the paper's rule): the lift stops `burst / weight`
below that floor, so a tenant that returns after leaving its share unused keeps up to `burst` cost
units of it. The credit refills only while the tenant is idle and only as fast as the others'
counters advance (its own counter stays where it left off), like a token bucket of depth `burst`
filled at the tenant's fair share. A quiet tenant's short burst is then served ahead of a flooding
tenant instead of alternating with it, and the lead bound grows by exactly `burst`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

from policies.fair_queue.base import Head, WeightFn


class VTCPolicy:
    """Weighted VTC with lift-to-minimum, minus an optional bounded burst credit.

    Args:
        weight_of: a tenant's weight (> 0), looked up at each use.
        burst: cost units of unused share a returning tenant may keep (>= 0).
    """

    name = "vtc"

    def __init__(self, weight_of: WeightFn, burst: float = 0.0) -> None:
        if not (math.isfinite(burst) and burst >= 0):
            raise ValueError(f"vtc_burst must be a finite number >= 0, got {burst!r}")
        self._weight_of = weight_of
        self._burst = burst
        self._counter: dict[str, float] = {}
        self._last_left: str | None = None

    def counter(self, tenant: str) -> float:
        """The tenant's virtual counter (weighted service received, after lifts)."""
        return self._counter.get(tenant, 0.0)

    def on_backlogged(self, tenant: str, others: Collection[str]) -> None:
        if others:
            floor = min(self.counter(t) for t in others)
        elif self._last_left is not None:
            # Nobody is waiting: the last tenant to leave the queue marks "now" in virtual time.
            floor = self.counter(self._last_left)
        else:
            return
        floor -= self._burst / self._weight_of(tenant)
        self._counter[tenant] = max(self.counter(tenant), floor)

    def on_idle(self, tenant: str) -> None:
        self._last_left = tenant

    def select(self, heads: Mapping[str, Head]) -> str:
        # Exact ties happen right after a lift (the newcomer sits at the minimum): they go to the
        # tenant with fewer requests in service, so a quiet tenant does not wait one more dispatch
        # behind a flooding one; then to the tenant waiting longest.
        return min(heads, key=lambda t: (self.counter(t), heads[t].in_flight, heads[t].oldest_seq))

    def charge(self, tenant: str, amount: float) -> None:
        self._counter[tenant] = self.counter(tenant) + amount / self._weight_of(tenant)

    def state(self) -> dict[str, float]:
        return dict(self._counter)
