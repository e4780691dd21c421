"""The lease strategy of `Admission` (`state.leases.strategy: leases`, policies/leases).

A request (not a batch line) is admitted from this process's slices and slots: at once when they
cover it (`admit_at_once`: no store call, no task), or after one top-up acquire (`admit`). Its
budgets are counters of micro-USD like its quotas: their slices hold money, and its worst case is
taken from them as its tokens are from a quota's. The budget levels its alerts compare with the
thresholds are the store's counter at this process's last acquire (every tick takes one for the keys
in use) less the units it holds and has not admitted: what is spent, what requests in flight
reserved, and what other processes hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from policies import ratelimit as rl
from policies.admission import budgeting
from policies.admission.refusals import refusal
from policies.admission.reservation import Reservation
from policies.admission.shapes import Shape, Shapes
from policies.errors import QuotaExceeded, StoreUnavailable
from policies.leases import LeasePath, LeaseSettings, PartitionSettings
from policies.principal import Principal
from policies.stores.base import CounterOp, StateStore
from policies.types import TenantSpec


class Admission(Protocol):
    """What the lease strategy uses of `policies.admission.service.Admission` (named here, not
    imported: the service imports this module)."""

    leases: LeasePath | None
    stats: dict[str, int]
    shapes: Shapes
    budget_watch: budgeting.BudgetWatch
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


def leaseable(adm: Admission, principal: Principal) -> bool:
    """Whether the request takes the lease path (leases on, not a batch line)."""
    return adm.leases is not None and principal.background is None


def admit_local(
    adm: Admission, principal: Principal, spec: TenantSpec, model: str, cost_tokens: int, cost_micros: int
) -> Reservation | None:
    """Admit from the slices and slots held, or None (then `admit_leased`)."""
    assert adm.leases is not None
    now = adm._clock()
    shape = adm.shapes.of(principal, spec, now)
    c = shape.checks(cost_tokens)
    budget_ops = shape.budget_ops(cost_micros)
    views = adm.leases.admit_local(c.buckets, c.leases, c.quota_ops + budget_ops if budget_ops else c.quota_ops, now)
    if views is None:
        return None
    return _reservation(adm, principal, model, cost_tokens, now, shape, rl.ratelimit_headers(c.buckets, views), cost_micros, budget_ops)  # fmt: skip


async def admit_leased(
    adm: Admission, principal: Principal, spec: TenantSpec, model: str, cost_tokens: int, cost_micros: int
) -> Reservation:
    """Admit from the slices held, topping them up from the store where they fall short.

    Raises as `Admission.admit` does.
    """
    assert adm.leases is not None
    now = adm._clock()
    shape = adm.shapes.of(principal, spec, now)
    c = shape.checks(cost_tokens)
    budget_ops = shape.budget_ops(cost_micros)
    counters = c.quota_ops + budget_ops
    views = adm.leases.admit_local(c.buckets, c.leases, counters, now)
    if views is None:
        try:
            result, views = await adm.leases.admit_remote(c.buckets, c.leases, counters, now)
        except StoreUnavailable:
            adm.stats["store_unavailable"] += 1
            raise
        if not result.ok:
            headers = rl.ratelimit_headers(c.buckets, [adm.leases.book.bucket_view(b.op.key, b.op, now) for b in c.buckets])
            over = budgeting.budget_denials(result, len(c.quota_checks), shape.budgets)
            error = refusal(principal.tenant, result, c.buckets, c.leases, c.quota_checks, headers, now, over, cost_micros)  # fmt: skip
            for check, used in over or []:
                adm.budget_watch.refused(check, used)
            adm.stats[error.code if isinstance(error, QuotaExceeded) else "rate_limited"] += 1
            raise error
    return _reservation(adm, principal, model, cost_tokens, now, shape, rl.ratelimit_headers(c.buckets, views), cost_micros, budget_ops)  # fmt: skip


def _reservation(
    adm: Admission,
    principal: Principal,
    model: str,
    cost_tokens: int,
    now: float,
    shape: Shape,
    headers: dict[str, str],
    cost_micros: int,
    budget_ops: list[CounterOp],
) -> Reservation:
    assert adm.leases is not None
    r = adm._granted(
        principal, model, cost_tokens, now, adm.reservation_id(), shape,
        headers=headers, cost_micros=cost_micros, budgets=budget_ops,
    )  # fmt: skip
    r.leased = True
    if budget_ops:  # the levels after this request, against the alert thresholds
        adm.budget_watch.admitted(shape.budgets, adm.leases.counter_levels(budget_ops), cost_micros)
    return r
