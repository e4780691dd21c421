"""The lease strategy of `Admission` (`state.leases.strategy: leases`, policies/leases).

A request with rate limits and quotas only (no budget, not a batch line) is admitted from this
process's slices and slots: at once when they cover it (`admit_at_once`: no store call, no task), or
after one top-up acquire (`admit`). A budget stays per request: its worst-case reservation is a
large share of a small budget, and the threshold alerts read the store's spend at each admission.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from policies import ratelimit as rl
from policies.admission.refusals import refusal
from policies.admission.reservation import Reservation
from policies.admission.shapes import Shape, Shapes
from policies.errors import QuotaExceeded, StoreUnavailable
from policies.leases import LeasePath, LeaseSettings, PartitionSettings
from policies.principal import Principal
from policies.stores.base import StateStore
from policies.types import TenantSpec


class Admission(Protocol):
    """What the lease strategy uses of `policies.admission.service.Admission` (named here, not
    imported: the service imports this module)."""

    leases: LeasePath | None
    stats: dict[str, int]
    shapes: Shapes
    _clock: Callable[[], float]

    def reservation_id(self) -> str: ...

    def _granted(self, principal: Principal, model: str, cost_tokens: int, now: float, lease_id: str, shape: Shape, **kw: Any) -> Reservation: ...  # noqa: E501


def lease_path(
    store: StateStore,
    instance: str,
    clock: Callable[[], float],
    leases: LeaseSettings | None,
    partition: PartitionSettings | None,
    lease_ttl_s: float,
) -> LeasePath | None:
    """The lease strategy's state, or None for the per-request strategy (or no settings)."""
    if leases is None or leases.strategy != "leases":
        return None
    return LeasePath(store, instance, clock, leases, partition, lease_ttl_s)


def leaseable(adm: Admission, principal: Principal, spec: TenantSpec) -> bool:
    """Whether the request takes the lease path (leases on, no budget, not a batch line)."""
    return (
        adm.leases is not None and principal.background is None and spec.budget is None and principal.budget is None
    )


def admit_local(adm: Admission, principal: Principal, spec: TenantSpec, model: str, cost_tokens: int) -> Reservation | None:
    """Admit from the slices and slots held, or None (then `admit_leased`)."""
    assert adm.leases is not None
    now = adm._clock()
    shape = adm.shapes.of(principal, spec, now)
    c = shape.checks(cost_tokens)
    views = adm.leases.admit_local(c.buckets, c.leases, c.quota_ops, now)
    if views is None:
        return None
    return _reservation(adm, principal, model, cost_tokens, now, shape, rl.ratelimit_headers(c.buckets, views))


async def admit_leased(adm: Admission, principal: Principal, spec: TenantSpec, model: str, cost_tokens: int) -> Reservation:
    """Admit from the slices held, topping them up from the store where they fall short.

    Raises as `Admission.admit` does.
    """
    assert adm.leases is not None
    now = adm._clock()
    shape = adm.shapes.of(principal, spec, now)
    c = shape.checks(cost_tokens)
    views = adm.leases.admit_local(c.buckets, c.leases, c.quota_ops, now)
    if views is None:
        try:
            result, views = await adm.leases.admit_remote(c.buckets, c.leases, c.quota_ops, now)
        except StoreUnavailable:
            adm.stats["store_unavailable"] += 1
            raise
        if not result.ok:
            headers = rl.ratelimit_headers(c.buckets, [adm.leases.book.bucket_view(b.op.key, b.op, now) for b in c.buckets])
            error = refusal(principal.tenant, result, c.buckets, c.leases, c.quota_checks, headers, now)
            adm.stats[error.code if isinstance(error, QuotaExceeded) else "rate_limited"] += 1
            raise error
    return _reservation(adm, principal, model, cost_tokens, now, shape, rl.ratelimit_headers(c.buckets, views))


def _reservation(
    adm: Admission, principal: Principal, model: str, cost_tokens: int, now: float, shape: Shape, headers: dict[str, str]
) -> Reservation:
    assert adm.leases is not None
    r = adm._granted(
        principal,
        model,
        cost_tokens,
        now,
        adm.reservation_id(),
        shape,
        headers=headers,
    )
    r.leased = True
    return r
