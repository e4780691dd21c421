"""Budgets in money per UTC day and month, on a tenant and on a key.

A budget is a period counter of micro-USD (`b:t:<tenant>:usd:d:2026-11-21`, `b:k:<key_id>:usd:m:2026-11`)
checked and reserved at admission in the same all-or-nothing store step as the token quotas, at the
request's worst case (every prompt token, `max_tokens` at the output price, the per-request price),
and settled at the real cost: the counters are the quotas' counters, so a budget is exact across
replicas on Redis and survives kill -9 the same way (an orphaned reservation is refunded).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime

import msgspec

from fleetgate.spec import SpecBase
from policies import quotas as q
from policies.pricing import micros_of, usd
from policies.stores.base import CounterOp
from policies.types import Budget
from policies.urls import check_http_url

__all__ = ["Budget", "BudgetAlerts", "BudgetCheck", "BudgetEvent", "alert_once_op", "budget_checks", "crossed"]


class BudgetAlerts(SpecBase):
    """Events when a budget passes a share of itself, counting spend and reservations in flight:
    each threshold of each budget period is announced once across every replica."""

    #: shares of a budget that raise an event when passed (1.0: the budget is spent or refuses)
    thresholds: list[float] = msgspec.field(default_factory=lambda: [0.5, 0.8, 1.0])
    #: URL that each event is POSTed to as JSON, off the request path (null: logs and /metrics only)
    webhook_url: str | None = None
    #: seconds a webhook POST may take before it is abandoned (and logged)
    webhook_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        for t in self.thresholds:
            if isinstance(t, bool) or not (0 < t <= 1):
                raise ValueError(f"budget_alerts.thresholds must be in (0, 1], got {t!r}")
        if not (math.isfinite(self.webhook_timeout_s) and self.webhook_timeout_s > 0):
            raise ValueError("budget_alerts.webhook_timeout_s must be a finite number > 0")
        if self.webhook_url is not None:
            check_http_url(self.webhook_url, "budget_alerts.webhook_url")


class BudgetCheck(msgspec.Struct, frozen=True, kw_only=True):
    """One budget of a request's admission: whose, which period, its limit and counter."""

    tenant: str
    #: the key whose own budget this is, or None for the tenant's
    key_id: str | None
    #: "usd_per_day" | "usd_per_month"
    name: str
    limit_micros: int
    key: str
    resets_at: float

    def op(self, cost_micros: int) -> CounterOp:
        """The counter op reserving `cost_micros` (the limit is enforced at acquire, not at settle)."""
        return CounterOp(self.key, self.limit_micros, cost_micros, self.resets_at + q.GRACE_S)

    @property
    def scope(self) -> str:
        """How messages name the budget's owner."""
        return f"tenant {self.tenant!r}" if self.key_id is None else f"key {self.key_id}"

    def reset_iso(self) -> str:
        return datetime.fromtimestamp(self.resets_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def limit_text(self) -> str:
        """The limit in USD as configured: cents at least, every micro-USD it has (a budget of
        0.004 USD read `0.00 USD` with two decimals)."""
        whole = f"{usd(self.limit_micros):.6f}".rstrip("0")
        return whole + "0" * max(0, 2 - len(whole.partition(".")[2]))

    def refusal(self, used_micros: int, cost_micros: int) -> str:
        """Why a request was refused: the budget, what is left, when it resets."""
        left = max(0, self.limit_micros - used_micros)
        state = "is spent" if left == 0 else f"has {usd(left):.6f} USD left, less than this request may cost ({usd(cost_micros):.6f} USD)"  # fmt: skip
        return (
            f"budget {self.name} of {self.scope} {state} ({usd(used_micros):.6f} of "
            f"{self.limit_text()} USD used or reserved); it resets at {self.reset_iso()}"
        )


def budget_checks(tenant: str, key_id: str | None, budget: Budget | None, now: float) -> list[BudgetCheck]:
    """The budgets of a tenant (`key_id` None) or of one of its keys, for the periods of `now`."""
    if budget is None:
        return []
    prefix = f"t:{tenant}" if key_id is None else f"k:{key_id}"
    day, month, d_end, m_end = q.periods(now)
    table = [
        ("usd_per_day", budget.usd_per_day, f"d:{day}", d_end),
        ("usd_per_month", budget.usd_per_month, f"m:{month}", m_end),
    ]
    # a positive budget below half a micro-USD rounds to 0: it is one micro-USD instead (the least
    # the store can hold), never a 0 that admits nothing priced yet divides the used ratio
    return [
        BudgetCheck(
            tenant=tenant, key_id=key_id, name=name, limit_micros=max(1, micros_of(limit)),
            key=f"b:{prefix}:usd:{period}", resets_at=end,
        )  # fmt: skip
        for name, limit, period, end in table
        if limit is not None
    ]


class BudgetEvent(msgspec.Struct, frozen=True, kw_only=True):
    """A budget passed one of its alert thresholds (logged, on /metrics, to the webhook)."""

    tenant: str
    #: the key whose own budget passed it, or None for the tenant's budget
    key_id: str | None
    #: "usd_per_day" | "usd_per_month"
    budget: str
    #: fraction of the budget, as configured (0.5, 0.8, 1.0)
    threshold: float
    used_usd: float
    limit_usd: float
    resets_at: str
    #: the store counter this is about; the event's once-only mark is derived from it
    counter: str


def crossed(check: BudgetCheck, before: int, after: int, thresholds: list[float]) -> list[BudgetEvent]:
    """The thresholds that spend or reservations moving from `before` to `after` micro-USD passed."""
    return [
        BudgetEvent(
            tenant=check.tenant,
            key_id=check.key_id,
            budget=check.name,
            threshold=t,
            used_usd=usd(after),
            limit_usd=usd(check.limit_micros),
            resets_at=check.reset_iso(),
            counter=check.key,
        )
        for t in thresholds
        if before < t * check.limit_micros <= after
    ]


def alert_once_op(event: BudgetEvent, resets_at: float) -> CounterOp:
    """A counter that admits one increment: the first replica to take it sends the event, so each
    threshold of each budget period is announced once across every replica."""
    return CounterOp(f"{event.counter}:alert:{event.threshold:g}", 1, 1, resets_at + q.GRACE_S)
