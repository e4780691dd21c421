"""The interface between the fair queue and its ordering policies (FCFS, VTC, DRR).

The queue owns the per-tenant FIFO queues and the capacity gate; a policy only answers "which
backlogged tenant goes next" and keeps whatever accounting it needs to answer that. The queue
calls, in order of a request's life:

- `on_backlogged(t, others)` when tenant t's queue goes from empty to non-empty,
- `select(heads)` when capacity is free, then `charge(t, cost)` for the request it dispatches,
- `on_idle(t)` when t's queue becomes empty (dispatch, cancellation or deadline),
- `charge(t, delta)` again as service is delivered or reconciled (delta may be negative).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import NamedTuple, Protocol

#: Weight of a tenant (> 0). Looked up at each use so weight updates apply at once.
WeightFn = Callable[[str], float]


class Head(NamedTuple):
    """What a policy may see of a backlogged tenant's queue."""

    cost: float  # estimated cost of the request that would be dispatched next
    seq: int  # arrival number of that request (global, increasing)
    oldest_seq: int  # arrival number of the tenant's oldest queued request
    in_flight: int = 0  # the tenant's requests dispatched and not yet released


class SchedulingPolicy(Protocol):
    """Chooses the next tenant to serve among the backlogged ones."""

    name: str

    def on_backlogged(self, tenant: str, others: Collection[str]) -> None:
        """Tenant's queue became non-empty; `others` are the tenants already backlogged."""

    def on_idle(self, tenant: str) -> None:
        """Tenant's queue became empty."""

    def select(self, heads: Mapping[str, Head]) -> str:
        """The tenant (a key of the non-empty `heads`) whose head request is dispatched next."""

    def charge(self, tenant: str, amount: float) -> None:
        """Account `amount` cost units of service to tenant (negative to refund)."""

    def state(self) -> dict[str, float]:
        """Per-tenant policy state for metrics (virtual counters, deficits)."""
