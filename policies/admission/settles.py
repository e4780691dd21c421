"""The store settles admission writes: what a reservation gives back, charges and records.

Each function builds the keyword arguments of one `StateStore.settle` call (pure: no store, no
clock). A settle id makes each of them apply at most once, so retrying any of them is harmless.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.admission.reservation import Reservation
from policies.stores.base import CounterOp, Journal, UsageDelta


def reconcile_settle(
    r: Reservation,
    actual_tokens: int,
    failed: bool,
    parts: Mapping[str, int] | None,
    now: float,
    cost_micros: int = 0,
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
        usage=usage_of(r, actual_tokens, failed, parts, cost_micros),
        now=now,
    )


def usage_of(
    r: Reservation,
    actual_tokens: int,
    failed: bool,
    parts: Mapping[str, int] | None = None,
    cost_micros: int = 0,
) -> list[UsageDelta]:
    """The usage rows of a request (none counted as a request when it failed) and of its parts; the
    request's spend is on its own rows (its parts' are within it)."""
    requests = 0 if failed else 1
    usage = [UsageDelta(r.tenant, r.model, p, requests, actual_tokens, cost_micros) for p in (r.day, r.month)]
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
    reservations refunded, no usage (nothing of it was acknowledged)."""
    return dict(
        settle_id=rid,
        lease_id=rid,
        buckets=[],
        release=journal.leases,
        counters=[CounterOp(c.key, None, -c.cost, c.expires_at) for c in journal.counters],
        usage=[],
        now=now,
    )
