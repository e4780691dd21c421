"""Budgets in an admission: which apply, the refusals they give, and the alerts they raise.

The budgets of a request (its tenant's, its key's own) are period counters of micro-USD reserved
in the same store acquire as its quotas (see policies/budgets.py). After each admission the
counters it saw are compared with the alert thresholds; each threshold passed is claimed once in the
store (a counter that admits one increment), so every replica may see it but only one announces it,
in a task of its own: an alert never delays the request that raised it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import structlog

from policies.budgets import BudgetCheck, BudgetEvent, alert_once_op, budget_checks, crossed
from policies.errors import BudgetExceeded, NeverAdmitted, StoreUnavailable
from policies.pricing import usd
from policies.principal import Principal
from policies.stores.base import AcquireResult, StateStore
from policies.types import TenantSpec

log = structlog.get_logger(__name__)

#: (counter, threshold) pairs this process announced or saw claimed, kept at most this many
_MAX_SEEN = 10_000


class BudgetSink(Protocol):
    """Where budget levels and events go (the gateway: logs, /metrics, the webhook)."""

    def level(self, check: BudgetCheck, used_micros: int) -> None: ...

    def announce(self, event: BudgetEvent) -> None: ...


def request_budgets(principal: Principal, spec: TenantSpec, now: float) -> list[BudgetCheck]:
    """The budgets a request of `principal` is reserved against: its tenant's, then its key's own."""
    return budget_checks(principal.tenant, None, spec.budget, now) + budget_checks(
        principal.tenant, principal.key_id, principal.budget, now
    )


def refuse_unaffordable(checks: list[BudgetCheck], cost_micros: int) -> None:
    """Raise NeverAdmitted for a request whose worst case is more than a whole budget period holds."""
    for c in checks:
        if cost_micros > c.limit_micros:
            raise NeverAdmitted(
                f"request may cost {usd(cost_micros):.6f} USD, more than the budget {c.name} of "
                f"{c.scope} ({c.limit_text()} USD) can ever hold; lower max_tokens"
            )


def budget_denials(
    result: AcquireResult, quotas: int, checks: list[BudgetCheck]
) -> list[tuple[BudgetCheck, int]] | None:
    """The budgets that refused an acquire, with their counters (budget ops follow the `quotas`
    quota ops); None when a quota refused too (a spent quota is named first) or no budget did."""
    counters = [d.index for d in result.denials if d.kind == "counter"]
    if not counters or min(counters) < quotas:
        return None
    return [(checks[i - quotas], result.counters[i]) for i in counters]


def budget_refusal(
    check: BudgetCheck, used_micros: int, cost_micros: int, headers: dict[str, str], now: float
) -> BudgetExceeded:
    """The 429 of a budget that cannot take this request now."""
    return BudgetExceeded(
        check.refusal(used_micros, cost_micros), retry_after_s=check.resets_at - now, headers=headers
    )


class BudgetWatch:
    """Follows budget counters through admissions and announces each threshold passed once.

    Args:
        store: the shared store, where each announcement is claimed once across replicas.
        thresholds: shares of a budget that raise an event (`budget_alerts.thresholds`).
        sink: where levels and events go (None: nowhere, e.g. the CLI).
        clock: epoch seconds now (the claims' counters expire after their period).
    """

    def __init__(
        self, store: StateStore, thresholds: list[float], sink: BudgetSink | None, clock: Callable[[], float]
    ) -> None:
        self._store = store
        self._clock = clock
        self.thresholds = sorted(thresholds)
        self._sink = sink
        self._seen: set[tuple[str, float]] = set()
        #: counter -> its level at this process's last admission: a level may move between two of
        #: them (other processes' spend, read at once with leases' next acquire), and a threshold
        #: passed so is announced by the next admission here
        self._last: dict[str, int] = {}
        self._claims: set[asyncio.Task[None]] = set()

    def admitted(self, checks: list[BudgetCheck], values: list[int | None], cost_micros: int) -> None:
        """The counters after an admission reserved `cost_micros` on each of `checks` (None: a level
        not known, as for a lease counter this process has never seen in the store)."""
        for check, after in zip(checks, values, strict=True):
            if after is None:
                continue
            if len(self._last) >= _MAX_SEEN:
                self._last.clear()  # past periods' counters
            self._level(check, after)
            before = min(after - cost_micros, self._last.get(check.key, after))
            self._last[check.key] = after
            for event in crossed(check, before, after, self.thresholds):
                self._announce_once(event, check)

    def refused(self, check: BudgetCheck, used_micros: int) -> None:
        """A budget refused a request: every threshold up to its level, and 1.0 (it refuses now)."""
        self._level(check, used_micros)
        self._last[check.key] = used_micros
        events = crossed(check, -1, used_micros, self.thresholds)
        if 1.0 in self.thresholds and not any(e.threshold == 1.0 for e in events):
            (full,) = crossed(check, -1, check.limit_micros, [1.0])
            events.append(full)
        for event in events:
            self._announce_once(event, check)

    def _level(self, check: BudgetCheck, used_micros: int) -> None:
        if self._sink is not None:
            self._sink.level(check, used_micros)

    def _announce_once(self, event: BudgetEvent, check: BudgetCheck) -> None:
        if self._sink is None:
            return
        seen = (event.counter, event.threshold)
        if seen in self._seen:
            return
        if len(self._seen) >= _MAX_SEEN:
            self._seen.clear()  # past periods' pairs; a repeat is still refused by the store's claim
        self._seen.add(seen)
        task = asyncio.ensure_future(self._claim(event, check, seen))
        self._claims.add(task)
        task.add_done_callback(self._claims.discard)

    async def _claim(self, event: BudgetEvent, check: BudgetCheck, seen: tuple[str, float]) -> None:
        op = alert_once_op(event, check.resets_at)
        try:
            result = await self._store.acquire(
                lease_id="", lease_ttl_s=0.0, buckets=[], leases=[], counters=[op], now=self._clock()
            )
        except StoreUnavailable as exc:
            self._seen.discard(seen)  # tried again by a later admission
            log.warning("budget_alert_not_claimed", counter=event.counter, error=exc.detail)
            return
        if result.ok and self._sink is not None:
            self._sink.announce(event)

    async def settled(self) -> None:
        """Wait for the claims in flight (tests, shutdown)."""
        while self._claims:
            await asyncio.gather(*self._claims, return_exceptions=True)
