"""This process's heartbeat in the state store, and the release of what dead processes left reserved.

Every admitted request's leases and quota reservations are journaled with the id of the process
that admitted them (policies.admission). This task renews that process's heartbeat and, every few
seconds (and once at start-up), settles the journaled reservations of processes whose heartbeat
has lapsed: after a `kill -9`, the tenant's concurrency slots and reserved quota come back within
about `HEARTBEAT_TTL_S + RECOVER_EVERY_S` seconds on a replica that was running, or twice that on a
process started after the crash.
"""

from __future__ import annotations

import asyncio

import structlog

from policies.admission import Admission
from policies.errors import StoreUnavailable

log = structlog.get_logger(__name__)

#: how often the heartbeat is renewed, and how long one lasts without renewal (margin for event-loop
#: stalls and clock skew between hosts: replicas' clocks must agree to well within this)
HEARTBEAT_EVERY_S = 2.0
HEARTBEAT_TTL_S = 12.0
#: how often orphaned reservations are looked for
RECOVER_EVERY_S = 4.0


async def start(admission: Admission) -> asyncio.Task[None]:
    """Beat once, then keep beating and releasing what dead processes left, in a background task.

    Nothing is released at start-up: the one rule (reclaim only after beating for a whole TTL) also
    covers a process that starts just as the store comes back from an outage, when every live
    process's heartbeat has lapsed.
    """
    try:
        await admission.heartbeat(HEARTBEAT_TTL_S)
    except StoreUnavailable as exc:
        log.error("liveness_start_failed", error=exc.detail)
    return asyncio.create_task(_run(admission), name="fleetgate-liveness")


async def _run(admission: Admission) -> None:
    since_recover = 0.0
    # Seconds of unbroken heartbeats. After a store outage every process's heartbeat has lapsed;
    # reclaiming only once this process has beaten for a whole TTL gives every live process time
    # to beat again first, so a live process's reservations are never taken.
    beating_s = 0.0
    while True:
        await asyncio.sleep(HEARTBEAT_EVERY_S)
        since_recover += HEARTBEAT_EVERY_S
        try:
            await admission.heartbeat(HEARTBEAT_TTL_S)
            beating_s += HEARTBEAT_EVERY_S
            if since_recover >= RECOVER_EVERY_S and beating_s > HEARTBEAT_TTL_S:
                since_recover = 0.0
                await admission.recover()
        except StoreUnavailable as exc:
            beating_s = 0.0
            log.warning("liveness_store_unavailable", error=exc.detail)
        except Exception:  # noqa: BLE001 - the task must outlive any one failure
            beating_s = 0.0
            log.exception("liveness_failed")


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
