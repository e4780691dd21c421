"""Data the fair queue hands out: tickets for dispatched requests and stats for metrics."""

from __future__ import annotations

import msgspec


class Ticket(msgspec.Struct, kw_only=True):
    """A dispatched request's claim on one unit of backend capacity; give it back with `release`.

    Attributes:
        id: arrival number of the request in its queue.
        tenant: who sent it.
        cost: the cost estimate given to `acquire`.
        priority: its priority inside the tenant.
        enqueued_at: clock time it entered the queue.
        dispatched_at: clock time it left the queue for the backend.
        dispatch_seq: dispatch order in its queue (0, 1, 2, ...).
        charged: service charged to the tenant so far (estimate, then `charge` deltas).
        released: True once `release` ran (a second release is a no-op).
        background: dispatched from the background class.
    """

    id: int
    tenant: str
    cost: float
    priority: int
    enqueued_at: float
    dispatched_at: float
    dispatch_seq: int
    charged: float = 0.0
    released: bool = False
    #: dispatched from the background class (batch jobs; see policies/fair_queue/background.py)
    background: bool = False

    @property
    def queue_time_s(self) -> float:
        """Seconds spent waiting in the queue."""
        return self.dispatched_at - self.enqueued_at


class TenantQueueStats(msgspec.Struct, kw_only=True):
    """Counters of one tenant on one deployment queue (monotonic except depth/in_flight)."""

    weight: float = 1.0
    depth: int = 0  # requests waiting now
    in_flight: int = 0  # requests dispatched and not released
    virtual: float | None = None  # policy state: VTC counter, DRR deficit; None for FCFS
    admitted: int = 0  # entered the queue
    dispatched: int = 0  # left the queue for the backend
    completed: int = 0  # released
    rejected_tenant_full: int = 0  # 429 tenant_queue_full
    rejected_queue_full: int = 0  # 503 queue_full
    expired: int = 0  # 504, deadline passed while queued
    cancelled: int = 0  # caller went away while queued
    service: float = 0.0  # cost units charged (estimates, increments and reconciliation)
    queue_time_sum_s: float = 0.0  # total queue time of dispatched requests
    queue_time_max_s: float = 0.0


class QueueStats(msgspec.Struct, kw_only=True):
    """Snapshot of a deployment queue for metrics and the admin API."""

    policy: str
    max_concurrency: int
    in_flight: int
    depth: int
    tenants: dict[str, TenantQueueStats]
    #: the background class (batch jobs): dispatched and waiting (not counted in the tenants' stats)
    background_in_flight: int = 0
    background_depth: int = 0
