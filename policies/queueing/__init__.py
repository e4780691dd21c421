"""Building blocks of the fair queue (`policies.fair_queue.FairQueue`): spec, errors, policies."""

from policies.queueing.base import Head, SchedulingPolicy
from policies.queueing.drr import DRRPolicy
from policies.queueing.errors import QueueDeadlineExceeded, QueueError, QueueFull
from policies.queueing.fcfs import FCFSPolicy
from policies.queueing.spec import QueueSpec
from policies.queueing.types import QueueStats, TenantQueueStats, Ticket
from policies.queueing.vtc import VTCPolicy

__all__ = [
    "DRRPolicy",
    "FCFSPolicy",
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
