"""Helpers for the fair-queue tests: a discrete-event backend simulator (the hand-moved clock and its
`clock` fixture are the policy tests' own, tests/policies/conftest.py)."""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Iterable

from policies.fair_queue import FairQueue, Ticket
from tests.policies.conftest import FakeClock


async def settle(rounds: int = 3) -> None:
    """Let woken waiters run (each grant resumes its task on the next loop iteration)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class Sim:
    """Drives a FairQueue like a backend with `max_concurrency` servers on the fake clock.

    Each dispatched ticket is served for `cost x seconds_per_unit` seconds, then released.
    `on_event` runs after every arrival/completion batch has settled (invariant checks).
    """

    def __init__(self, fq: FairQueue, clock: FakeClock, seconds_per_unit: float = 0.01) -> None:
        self.fq = fq
        self.clock = clock
        self.spu = seconds_per_unit
        self.tasks: list[asyncio.Task[Ticket]] = []
        self.served: list[Ticket] = []  # released tickets, in completion order
        self._running: list[tuple[float, int, Ticket]] = []  # (finish time, dispatch_seq, ticket)
        self._seen: set[int] = set()

    def submit(self, tenant: str, cost: float, **kwargs: object) -> asyncio.Task[Ticket]:
        task = asyncio.ensure_future(self.fq.acquire(tenant, cost, **kwargs))  # type: ignore[arg-type]
        self.tasks.append(task)
        return task

    def _collect_started(self) -> None:
        for task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                ticket = task.result()
                if ticket.dispatch_seq not in self._seen:
                    self._seen.add(ticket.dispatch_seq)
                    finish = ticket.dispatched_at + ticket.cost * self.spu
                    heapq.heappush(self._running, (finish, ticket.dispatch_seq, ticket))
        self.tasks = [t for t in self.tasks if not t.done()]

    async def run(
        self,
        arrivals: Iterable[tuple[float, str, float]] = (),
        on_event: Callable[[], None] | None = None,
    ) -> list[Ticket]:
        """Replay (seconds from now, tenant, cost) arrivals and serve until everything is done."""
        start = self.clock.now
        pending = sorted(((start + t, tenant, cost) for t, tenant, cost in arrivals), key=lambda a: a[0])
        i = 0
        await settle()
        self._collect_started()
        while i < len(pending) or self._running or self.tasks:
            next_arrival = pending[i][0] if i < len(pending) else float("inf")
            next_finish = self._running[0][0] if self._running else float("inf")
            if next_arrival == next_finish == float("inf"):
                raise AssertionError("stuck: requests wait but nothing runs (work conservation broken)")
            if next_arrival <= next_finish:
                self.clock.now = max(self.clock.now, next_arrival)
                while i < len(pending) and pending[i][0] <= self.clock.now:
                    _, tenant, cost = pending[i]
                    self.submit(tenant, cost)
                    i += 1
            else:
                self.clock.now = max(self.clock.now, next_finish)
                while self._running and self._running[0][0] <= self.clock.now:
                    ticket = heapq.heappop(self._running)[2]
                    self.fq.release(ticket)
                    self.served.append(ticket)
            await settle()
            self._collect_started()
            if on_event is not None:
                on_event()
        return sorted(self.served, key=lambda t: t.dispatch_seq)
