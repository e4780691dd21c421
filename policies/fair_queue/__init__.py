"""The fair queue of a deployment: `FairQueue` (queue.py) and its parts (spec, errors, policies,
per-tenant queues, backlog and deadlines), all in this one package."""

from policies.fair_queue.base import Head, SchedulingPolicy
from policies.fair_queue.drr import DRRPolicy
from policies.fair_queue.errors import QueueDeadlineExceeded, QueueError, QueueFull
from policies.fair_queue.fcfs import FCFSPolicy

# last: queue.py imports the parts above
from policies.fair_queue.queue import FairQueue  # noqa: E402
from policies.fair_queue.spec import QueueSpec
from policies.fair_queue.types import QueueStats, TenantQueueStats, Ticket
from policies.fair_queue.vtc import VTCPolicy

__all__ = [
    "DRRPolicy",
    "FCFSPolicy",
    "FairQueue",
    "Head",
    "QueueDeadlineExceeded",
    "QueueError",
    "QueueFull",
    "QueueSpec",
    "QueueStats",
    "SchedulingPolicy",
    "TenantQueueStats",
    "Ticket",
    "VTCPolicy",
]
