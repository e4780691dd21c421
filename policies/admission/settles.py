"""The store settles admission writes: what a reservation gives back, charges and records.

Each function builds the keyword arguments of one `StateStore.settle` call (pure: no store, no
clock). A settle id makes each of them apply at most once, so retrying any of them is harmless.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog

from policies.admission.reservation import Reservation
from policies.stores.base import BucketOp, CounterOp, Journal, StateStore, UsageDelta
from policies.types import KeyUsageRow

log = structlog.get_logger(__name__)


def reconcile_settle(
    r: Reservation,
    actual_tokens: int,
    failed: bool,
    parts: Mapping[str, int] | None,
    now: float,
    cost_micros: int = 0,
    deployment: str = "",
) -> dict[str, Any]:
    """The settle of a finished request: unused tokens and money refunded (or the excess charged),
    usage and spend recorded per day and month (a graph's `parts` beside it), its concurrency
    leases released."""
    delta = actual_tokens - r.cost_tokens
    counters = [CounterOp(c.key, None, delta, c.expires_at) for c in r.token_quotas]
    if failed:
        counters += [CounterOp(c.key, None, -1, c.expires_at) for c in r.request_quotas]
    counters += [CounterOp(c.key, None, cost_micros - r.cost_micros, c.expires_at) for c in r.budgets]
    return dict(
        settle_id=r.id,
        lease_id=r.id,
        buckets=[b.with_cost(delta) for b in r.token_buckets],
        release=r.lease_keys,
        counters=counters,
        usage=usage_of(r, actual_tokens, failed, parts, cost_micros, deployment),
        now=now,
    )


def usage_of(
    r: Reservation,
    actual_tokens: int,
    failed: bool,
    parts: Mapping[str, int] | None = None,
    cost_micros: int = 0,
    deployment: str = "",
) -> list[UsageDelta]:
    """The usage rows of a request (none counted as a request when it failed) and of its parts; the
    request's spend is on its own rows (its parts' are within it). Beside its tenant's day and month
    rows, its key's day row, per model and deployment (months are summed from days when read)."""
    requests = 0 if failed else 1
    usage = [UsageDelta(r.tenant, r.model, p, requests, actual_tokens, cost_micros) for p in (r.day, r.month)]
    if requests or actual_tokens or cost_micros:  # a request that used nothing adds no key row
        usage.append(
            UsageDelta(r.tenant, r.model, r.day, requests, actual_tokens, cost_micros, r.key_id, deployment)
        )
    usage += [UsageDelta(r.tenant, m, p, 1, n) for m, n in (parts or {}).items() for p in (r.day, r.month)]
    return usage


def whole_charge(r: Reservation, actual_tokens: int, requests: int, cost_micros: int = 0) -> list[CounterOp]:
    """The quota and budget counters a request's whole real cost adds, for a store that holds none
    of its reservation (admitted on local state while the store was down, or refunded by a reclaim)."""
    charge = [CounterOp(c.key, None, actual_tokens, c.expires_at) for c in r.token_quotas]
    charge += [CounterOp(c.key, None, requests, c.expires_at) for c in r.request_quotas]
    charge += [CounterOp(c.key, None, cost_micros, c.expires_at) for c in r.budgets]
    return charge


def late_settle(
    r: Reservation, actual_tokens: int, requests: int, usage: list[UsageDelta], now: float, cost_micros: int = 0
) -> dict[str, Any]:
    """The settle of a reservation already refunded by a reclaim: its whole real cost, once."""
    charge = whole_charge(r, actual_tokens, requests, cost_micros)
    return dict(
        settle_id=f"late:{r.id}", lease_id=r.id, buckets=[], release=[], counters=charge, usage=usage, now=now
    )


def orphan_settle(rid: str, journal: Journal, now: float) -> dict[str, Any]:
    """The settle of a dead process's reservation, as a failure: leases released, quota
    reservations and a slice's bucket units refunded, no usage (nothing of it was acknowledged)."""
    return dict(
        settle_id=rid,
        lease_id=rid,
        buckets=[BucketOp(b.key, b.capacity, b.rate_per_s, -b.cost) for b in journal.buckets],
        release=journal.leases,
        counters=[CounterOp(c.key, None, -c.cost, c.expires_at) for c in journal.counters],
        usage=[],
        now=now,
    )


def with_months(days: list[KeyUsageRow]) -> list[KeyUsageRow]:
    """Per-key day rows and, for each (tenant, key, model, deployment), its months' sums, sorted."""
    months: dict[tuple[str, str, str, str, str], list[int | float]] = {}
    for d in days:
        k = (d.tenant, d.key_id, d.model, d.deployment, d.period[:7])
        sums = months.setdefault(k, [0, 0, 0])
        sums[0] += d.requests
        sums[1] += d.tokens
        sums[2] += round(d.cost_usd * 1_000_000)  # exact: the store's sums are whole micro-USD
    rows = days + [
        KeyUsageRow(
            tenant=t, key_id=key, model=m, deployment=dep, period=p, requests=int(r), tokens=int(n), cost_usd=c / 1e6
        )
        for (t, key, m, dep, p), (r, n, c) in months.items()
    ]
    return sorted(rows, key=lambda r: (r.tenant, r.key_id, r.model, r.deployment, r.period))


async def recover_orphans(store: StateStore, now: float) -> int:
    """Settle as failures the reservations whose process has no live heartbeat; returns how many.

    Each is settled as a failure: its leases are released, its quota reservations and slices
    refunded; no usage is recorded (nothing of it was acknowledged by a settle). Its settle id is the
    reservation's, so should that process come back and settle it after all, the second is a no-op.
    """
    orphans = await store.orphans(now)
    for rid, journal in orphans:
        await store.settle(**orphan_settle(rid, journal, now))
    if orphans:
        log.warning("orphaned_reservations_released", count=len(orphans))
    return len(orphans)
