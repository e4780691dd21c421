"""Deficit round robin (Shreedhar & Varghese, 1995) over tenants, with weighted quanta.

Backlogged tenants sit in a ring. The tenant at the front sends requests while its deficit covers
the cost of its head request; when it cannot, its turn ends, it moves to the back, and the next
tenant's deficit grows by `quantum x weight`. A tenant that goes idle loses its deficit.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection, Mapping

from policies.fair_queue.base import Head, WeightFn


class DRRPolicy:
    """Weighted deficit round robin; the cost estimate is charged at dispatch."""

    name = "drr"

    def __init__(self, weight_of: WeightFn, quantum: float) -> None:
        if not (math.isfinite(quantum) and quantum > 0):
            raise ValueError("drr_quantum must be a finite number > 0")
        self._weight_of = weight_of
        self._quantum = quantum
        self._ring: deque[str] = deque()
        self._deficit: dict[str, float] = {}

    def _grant_quantum(self, tenant: str, rounds: int = 1) -> None:
        self._deficit[tenant] += rounds * self._quantum * self._weight_of(tenant)

    def on_backlogged(self, tenant: str, others: Collection[str]) -> None:
        self._ring.append(tenant)
        self._deficit[tenant] = 0.0
        if len(self._ring) == 1:
            self._grant_quantum(tenant)  # its turn starts now

    def on_idle(self, tenant: str) -> None:
        if tenant not in self._deficit:
            return
        was_front = self._ring[0] == tenant
        self._ring.remove(tenant)
        del self._deficit[tenant]
        if was_front and self._ring:
            self._grant_quantum(self._ring[0])  # the turn passes on

    def select(self, heads: Mapping[str, Head]) -> str:
        ring = self._ring
        misses = 0
        while True:
            front = ring[0]
            if self._deficit[front] >= heads[front].cost:
                return front
            misses += 1
            if misses >= len(ring):
                # Nobody can afford its head (quantum smaller than costs): skip the idle rounds
                # in one step instead of looping through them.
                self._skip_rounds(heads)
                misses = 0
            ring.rotate(-1)
            self._grant_quantum(ring[0])

    def _skip_rounds(self, heads: Mapping[str, Head]) -> None:
        needed = min(
            math.ceil((heads[t].cost - self._deficit[t]) / (self._quantum * self._weight_of(t)))
            for t in self._ring
        )
        if needed > 1:
            for t in self._ring:
                self._grant_quantum(t, needed - 1)

    def charge(self, tenant: str, amount: float) -> None:
        # Service reconciled after the tenant went idle is forgotten, like its deficit.
        if tenant in self._deficit:
            self._deficit[tenant] -= amount

    def state(self) -> dict[str, float]:
        return dict(self._deficit)
