"""Building a queue's ordering policy and checking its weight table."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from policies.fair_queue.base import SchedulingPolicy
from policies.fair_queue.drr import DRRPolicy
from policies.fair_queue.fcfs import FCFSPolicy
from policies.fair_queue.spec import QueueSpec
from policies.fair_queue.vtc import VTCPolicy

#: weight of a tenant the weight table does not list
DEFAULT_WEIGHT = 1.0


def make_policy(spec: QueueSpec, weight_of: Callable[[str], float]) -> SchedulingPolicy:
    """The scheduling policy named by `spec.policy`."""
    if spec.policy == "fcfs":
        return FCFSPolicy()
    if spec.policy == "drr":
        return DRRPolicy(weight_of, spec.drr_quantum)
    return VTCPolicy(weight_of, spec.vtc_burst or 0.0)


def check_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """A copy of `weights`; raises ValueError naming the tenant whose weight is not finite and > 0."""
    for tenant, w in weights.items():
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"weight of tenant {tenant!r} must be a finite number > 0, got {w!r}")
    return dict(weights)
