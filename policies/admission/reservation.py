"""What admission took for one request (`Reservation`), and which tenants need no store at all.

A reservation is handed back to `Admission.reconcile` exactly once; it carries everything the
settle needs (the buckets and quota counters charged, the leases held, the UTC periods).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from policies import ratelimit as rl
from policies.stores.base import CounterOp
from policies.types import Limits, Quotas, TenantSpec


class Reservation(msgspec.Struct, kw_only=True):
    """What `admit` took for one request; hand it back to `reconcile` exactly once (more is a no-op).

    Attributes:
        id: unique id (also the store's settle id, so a repeated reconcile is harmless).
        tenant, key_id, model: who and what.
        cost_tokens: tokens reserved (tokens/min buckets and token quotas).
        cost_micros: the worst-case cost in micro-USD reserved on `budgets` (settled at the real cost).
        budgets: the budget counters reserved (the tenant's, the key's own).
        day, month: UTC periods charged (a request that ends after midnight stays on its first day).
        token_buckets, token_quotas, request_quotas, lease_keys: the buckets, quota counters and
            concurrency leases charged (their keys and expiries: a settle computes its own costs).
            Shared by every reservation of one key's shape (`shapes.py`): read, never modify.
        headers: x-ratelimit-* headers computed at admission.
        degraded: admitted while the store was down (fail open), against this replica's local state.
        settled: reconcile has run.
    """

    id: str
    tenant: str
    key_id: str
    model: str
    cost_tokens: int
    admitted_at: float
    day: str
    month: str
    token_buckets: list[rl.RateCheck]
    token_quotas: list[CounterOp]
    request_quotas: list[CounterOp]
    lease_keys: list[str]
    headers: dict[str, str]
    degraded: bool = False
    settled: bool = False
    renewed_at: float = 0.0
    #: a background request's HeldSettle: `reconcile` hands it the settlement instead of applying it
    held: Any = None
    cost_micros: int = 0
    budgets: list[CounterOp] = msgspec.field(default_factory=list)
    #: settled with this process's next lease batch (policies/leases): admitted from its slices, or
    #: a tenant's with nothing to check (usage only) while the lease strategy is on
    leased: bool = False


_NO_LIMITS, _NO_QUOTAS = Limits(), Quotas()


def unchecked_tenants(tenants: Mapping[str, TenantSpec]) -> frozenset[str]:
    """The tenants with no limit, per-key limit, quota or budget configured (once per config, not per
    request). A key's own limits or budget are checked whatever its tenant's (see `admit_at_once`)."""
    return frozenset(
        name
        for name, spec in tenants.items()
        if spec.limits == _NO_LIMITS
        and (spec.key_limits is None or spec.key_limits == _NO_LIMITS)
        and spec.quotas == _NO_QUOTAS
        and spec.budget is None
    )

