"""First come, first served across tenants: the baseline that lets a flood starve everyone."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from policies.fair_queue.base import Head


class FCFSPolicy:
    """Serves the tenant whose oldest queued request arrived first.

    Priorities only reorder requests inside a tenant: the tenant keeps the place in line of its
    oldest request, so raising a priority never moves a tenant ahead of others.
    """

    name = "fcfs"

    def on_backlogged(self, tenant: str, others: Collection[str]) -> None:
        return None

    def on_idle(self, tenant: str) -> None:
        return None

    def select(self, heads: Mapping[str, Head]) -> str:
        return min(heads, key=lambda t: heads[t].oldest_seq)

    def charge(self, tenant: str, amount: float) -> None:
        return None

    def state(self) -> dict[str, float]:
        return {}
