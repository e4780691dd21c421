"""The errors of a refused admission, each naming the limit or quota and when to retry.

`refuse_never_fitting` raises before any store round trip for a request no wait can admit;
`refusal` turns a refused store acquire into the error to raise (a spent quota first, else the
longest rate wait).
"""

from __future__ import annotations

from datetime import UTC, datetime

from policies import quotas as q
from policies import ratelimit as rl
from policies.admission.budgeting import budget_refusal
from policies.budgets import BudgetCheck
from policies.errors import NeverAdmitted, QuotaExceeded, RateLimited
from policies.stores.base import AcquireResult


def refusal(
    tenant: str,
    result: AcquireResult,
    buckets: list[rl.RateCheck],
    leases: list[rl.ConcurrencyCheck],
    quota_checks: list[q.QuotaCheck],
    headers: dict[str, str],
    now: float,
    over_budget: list[tuple[BudgetCheck, int]] | None = None,
    cost_micros: int = 0,
) -> QuotaExceeded | NeverAdmitted | RateLimited:
    """The error of a refused acquire: a spent quota first, then a budget that cannot take the
    request (`over_budget`: see `budget_denials`), else the longest rate wait."""
    if over_budget:
        check, used = over_budget[0]
        return budget_refusal(check, used, cost_micros, headers, now)
    for d in result.denials:
        if d.kind == "counter" and d.index < len(quota_checks):  # budgets follow the quotas
            c = quota_checks[d.index]
            reset = datetime.fromtimestamp(c.resets_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            used = result.counters[d.index]
            # the counter holds what was used before this request: when it is under the limit,
            # only this request's own reservation does not fit what is left
            state = "is spent" if used >= c.limit else f"has {c.limit - used} {c.unit} left, too few for this request"
            return QuotaExceeded(
                f"{c.name} quota of tenant {tenant!r} {state} "
                f"({used} of {c.limit} {c.unit} used); it resets at {reset}",
                retry_after_s=c.resets_at - now,
                headers=headers,
            )
    retries = [d.retry_after_s for d in result.denials if d.kind == "bucket"]
    d = result.denials[0]
    if d.kind == "bucket" and d.retry_after_s is None:  # checked before acquiring; kept for safety
        return _never_fits(buckets[d.index], headers)
    if d.kind == "lease":
        c = leases[d.index]
        return RateLimited(f"max_concurrency of {c.scope} reached ({c.limit})", retry_after_s=1.0, headers=headers)
    b = buckets[d.index]
    wait = max(r for r in retries if r is not None)
    return RateLimited(
        f"{b.name} limit of {b.scope} reached ({b.limit}); retry in {wait:.3f} s",
        retry_after_s=wait,
        headers=headers,
    )


def refuse_never_fitting(
    buckets: list[rl.RateCheck], quota_checks: list[q.QuotaCheck], cost_tokens: int, tenant: str
) -> None:
    """Raise NeverAdmitted, before any store round trip, for a request that no wait can admit: it
    needs more than a bucket's whole capacity or a quota's whole period (a 429 would have the
    client retry forever)."""
    for b in buckets:
        if b.op.cost > b.op.capacity:
            raise _never_fits(b, None)
    for c in quota_checks:
        if c.unit == "tokens" and cost_tokens > c.limit:
            raise NeverAdmitted(
                f"request needs {cost_tokens} tokens, more than the {c.name} quota of tenant {tenant!r} "
                f"({c.limit}) can ever hold"
            )


def _never_fits(b: rl.RateCheck, headers: dict[str, str] | None) -> NeverAdmitted:
    return NeverAdmitted(
        f"request needs {int(b.op.cost)} {b.unit}, more than the {b.name} limit of {b.scope} "
        f"({b.limit}) can ever hold",
        headers=headers,
    )
