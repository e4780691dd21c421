"""One turn in a deployment's fair queue: the single way every kind of work waits for a backend.

Tensors, slices of a large tensor request, embeddings, graph steps and generations (one choice or
`n`) all take their turn here, so queue time is measured, traced and released the same way for all.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from typing import Any

from fleetgate import tracing
from gateway.core.fleet.deployments import Deployment
from gateway.core.queue.hints import QueueHints
from gateway.observe import metrics
from policies.fair_queue import Ticket


async def take_turn(
    dep: Deployment, tenant: str, cost: float, hints: QueueHints, *, continuing: bool = False
) -> Ticket:
    """Wait for `tenant`'s turn in `dep`'s fair queue; the caller releases the ticket it gets.

    `hints` carry the call's priority, queue deadline and whether it is background work;
    `continuing` puts a later slice of a started request first among its own tenant's requests.
    """
    queued_at = time.perf_counter()
    with tracing.step("queue", **{"fleetgate.deployment": dep.name}):
        ticket = await dep.queue.acquire(
            tenant,
            cost,
            priority=hints.priority,
            timeout_s=hints.timeout_s,
            continuing=continuing,
            background=hints.background,
        )
    metrics.child(metrics.QUEUE_TIME, dep.name, tenant).observe(time.perf_counter() - queued_at)
    return ticket


async def run_in_turn(
    dep: Deployment,
    tenant: str,
    cost: float,
    work: Coroutine[Any, Any, Any],
    hints: QueueHints,
    *,
    continuing: bool = False,
) -> tuple[Any, float]:
    """Take a turn, await `work` in it, release the turn.

    Returns the work's result and the seconds it took once it had its turn (the service time).
    """
    try:
        ticket = await take_turn(dep, tenant, cost, hints, continuing=continuing)
    except BaseException:
        work.close()  # never awaited: close it so Python does not warn
        raise
    granted = time.perf_counter()
    try:
        with tracing.child("backend", **{"fleetgate.deployment": dep.name, "fleetgate.backend": dep.spec.backend}):
            return await work, time.perf_counter() - granted
    finally:
        dep.queue.release(ticket, cost)
