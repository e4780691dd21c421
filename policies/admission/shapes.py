"""Check shapes: what every request of one API key is checked against, built once per key, tenant
config and UTC day rather than on every request.

A key's requests (an API key's, or a JWT subject's; a batch job's lines apart, as they take quotas
and budgets only) take the same rate limits (the tenant's and the key's), concurrency limits,
quotas and budgets, under the same store keys, all day; only the tokens a request reserves vary. A `Shape` holds
the cost-free part and `Shape.checks(cost_tokens)` fills in the tokens; `Shapes` keeps the shapes of
the keys in use and builds a new one when the tenant's spec, the key's own limits or the UTC day
change (a reload, a key's limits or budget edited, midnight).
"""

from __future__ import annotations

from typing import NamedTuple

from policies import quotas as q
from policies import ratelimit as rl
from policies.admission.budgeting import refuse_unaffordable, request_budgets
from policies.admission.refusals import refuse_never_fitting
from policies.budgets import BudgetCheck
from policies.principal import Principal
from policies.stores.base import CounterOp
from policies.types import TenantSpec

#: shapes kept at most; past it the cache starts again (keys in use come back at their next request)
_MAX_SHAPES = 10_000


class Checks(NamedTuple):
    """The rate limits and quotas one request is checked against. Its lists may be the shape's own
    (shared by every request of the key): read them, never modify them."""

    buckets: list[rl.RateCheck]
    leases: list[rl.ConcurrencyCheck]
    quota_checks: list[q.QuotaCheck]
    #: one counter op per quota check, costing what the request reserves of it
    quota_ops: list[CounterOp]


class Shape:
    """The checks of one key's requests for one UTC day, less the tokens each request reserves."""

    __slots__ = (
        "spec", "limits", "budget", "budgets", "day_start", "day_end", "day", "month", "tenant", "_buckets", "leases", "quota_checks",
        "_quota_ops", "_token_buckets_at", "_token_quotas_at", "_max_tokens", "token_buckets", "token_quotas",
        "request_quotas", "lease_keys",
    )  # fmt: skip

    def __init__(self, principal: Principal, spec: TenantSpec, now: float) -> None:
        self.spec, self.limits, self.tenant = spec, principal.limits, principal.tenant
        self.budget = principal.budget
        #: the budgets every request of the key reserves on (its tenant's, then the key's own)
        self.budgets: list[BudgetCheck] = request_budgets(principal, spec, now)
        periods = q.periods(now)
        self.day_start, self.day_end = periods.day_end - 86400.0, periods.day_end
        self.day, self.month = periods.day, periods.month
        # A batch job's requests count against quotas (the bill) but not per-minute limits: those
        # shape interactive bursts, and the batch runner paces itself through the fair queue. A key's
        # own limits take the place of its tenant's per-key default.
        held = principal.background is not None
        key_limits = None if held else principal.limits or spec.key_limits
        t_buckets, t_leases = rl.rate_checks(f"tenant {principal.tenant}", f"t:{principal.tenant}", None if held else spec.limits, 0)  # fmt: skip
        k_buckets, k_leases = rl.rate_checks(f"key {principal.key_id}", f"k:{principal.key_id}", key_limits, 0)
        self._buckets = t_buckets + k_buckets
        self.leases = t_leases + k_leases
        self.quota_checks = q.quota_checks(principal.tenant, spec.quotas, now)
        self._quota_ops = [c.op(0 if c.unit == "tokens" else 1) for c in self.quota_checks]
        self._token_buckets_at = [i for i, b in enumerate(self._buckets) if b.unit == "tokens"]
        self._token_quotas_at = [i for i, c in enumerate(self.quota_checks) if c.unit == "tokens"]
        limits = [self._buckets[i].op.capacity for i in self._token_buckets_at]
        limits += [float(self.quota_checks[i].limit) for i in self._token_quotas_at]
        #: the most tokens a request may reserve and still fit some day (its one unit on a requests
        #: bucket always fits: limits are positive, policies/types.py)
        self._max_tokens = min(limits, default=float("inf"))
        # what a reservation keeps of the checks for its settle (the ops' keys and expiries)
        self.token_buckets = [self._buckets[i] for i in self._token_buckets_at]
        self.token_quotas = [self._quota_ops[i] for i in self._token_quotas_at]
        self.request_quotas = [op for op, c in zip(self._quota_ops, self.quota_checks, strict=True) if c.unit == "requests"]  # fmt: skip
        self.lease_keys = [c.op.key for c in self.leases]

    def holds(self, principal: Principal, spec: TenantSpec, now: float) -> bool:
        """Whether this shape is still the one of `principal`'s requests under `spec` at `now`."""
        return (
            self.spec is spec
            and (self.limits is principal.limits or self.limits == principal.limits)
            and (self.budget is principal.budget or self.budget == principal.budget)
            and self.day_start <= now < self.day_end
        )

    def checks(self, cost_tokens: int) -> Checks:
        """The checks of a request reserving `cost_tokens`; NeverAdmitted when no wait can admit it."""
        buckets, quota_ops = self._buckets, self._quota_ops
        if cost_tokens > self._max_tokens:  # more than some token limit holds: this raises
            costed = [b.costing(cost_tokens) if b.unit == "tokens" else b for b in buckets]
            refuse_never_fitting(costed, self.quota_checks, cost_tokens, self.tenant)
        if cost_tokens and (self._token_buckets_at or self._token_quotas_at):
            buckets = list(buckets)
            for i in self._token_buckets_at:
                buckets[i] = buckets[i].costing(cost_tokens)
            quota_ops = list(quota_ops)
            for i in self._token_quotas_at:
                quota_ops[i] = self.quota_checks[i].op(cost_tokens)
        return Checks(buckets, self.leases, self.quota_checks, quota_ops)

    def budget_ops(self, cost_micros: int) -> list[CounterOp]:
        """The counter ops reserving a request's worst case `cost_micros` on the key's budgets;
        NeverAdmitted when it is more than a budget holds in a whole period."""
        if not self.budgets:
            return []
        refuse_unaffordable(self.budgets, cost_micros)
        return [b.op(cost_micros) for b in self.budgets]


class Shapes:
    """The shapes of the keys in use in this process."""

    def __init__(self) -> None:
        self._shapes: dict[tuple[str, str, bool], Shape] = {}

    def of(self, principal: Principal, spec: TenantSpec, now: float) -> Shape:
        """The shape of `principal`'s requests under `spec` at `now` (built when it changed)."""
        key = (principal.tenant, principal.key_id, principal.background is None)
        shape = self._shapes.get(key)
        if shape is None or not shape.holds(principal, spec, now):
            if len(self._shapes) >= _MAX_SHAPES:
                self._shapes.clear()
            shape = self._shapes[key] = Shape(principal, spec, now)
        return shape

    def clear(self) -> None:
        """Forget every shape (a reload: the specs they were built from are gone)."""
        self._shapes.clear()
