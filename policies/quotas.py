"""Day and month quotas over UTC calendar periods.

A quota is a counter per tenant and period (`q:<tenant>:tokens:d:2026-11-21`), reserved at admission
and reconciled at the end like token limits. Period names double as the `period` of usage rows.
"""

from __future__ import annotations

import functools
from datetime import UTC, datetime, timedelta
from typing import NamedTuple

from policies.stores.base import CounterOp
from policies.types import Quotas

#: A period counter is kept this long after its period ends, so late refunds still find it.
GRACE_S = 86400.0


class Periods(NamedTuple):
    """The UTC day and month that contain an instant, and when each ends."""

    day: str  # "2026-11-21"
    month: str  # "2026-11"
    day_end: float  # epoch seconds of the next UTC midnight
    month_end: float  # epoch seconds of the first instant of the next UTC month


@functools.lru_cache(maxsize=4)
def _periods_of_day(day_index: int) -> Periods:
    d = datetime.fromtimestamp(day_index * 86400, UTC)
    first_of_next_month = datetime(d.year + (d.month == 12), d.month % 12 + 1, 1, tzinfo=UTC)
    return Periods(
        d.strftime("%Y-%m-%d"),
        d.strftime("%Y-%m"),
        (d + timedelta(days=1)).timestamp(),
        first_of_next_month.timestamp(),
    )


def periods(now: float) -> Periods:
    """The periods of `now`. Cached per UTC day (POSIX days are exactly 86400 s), because every
    admission asks and datetime arithmetic was ~13 us of each request's path."""
    return _periods_of_day(int(now // 86400))


def day_name(now: float) -> str:
    """The UTC day of `now`, e.g. "2026-11-21"."""
    return periods(now).day


def month_name(now: float) -> str:
    """The UTC month of `now`, e.g. "2026-11"."""
    return periods(now).month


def day_end(now: float) -> float:
    """Epoch seconds of the next UTC midnight after `now`."""
    return periods(now).day_end


def month_end(now: float) -> float:
    """Epoch seconds of the first instant of the next UTC month after `now`."""
    return periods(now).month_end


class QuotaCheck:
    """One configured quota of a tenant: what it counts, its limit, its period and its counter key."""

    __slots__ = ("name", "limit", "unit", "key", "resets_at")

    def __init__(self, name: str, limit: int, unit: str, key: str, resets_at: float) -> None:
        self.name = name  # e.g. "tokens_per_day"
        self.limit = limit
        self.unit = unit  # "tokens" | "requests"
        self.key = key
        self.resets_at = resets_at

    def op(self, cost: int) -> CounterOp:
        """The counter op adding `cost` (limit enforced at acquire, ignored at settle)."""
        return CounterOp(self.key, self.limit, cost, self.resets_at + GRACE_S)


def quota_checks(tenant: str, quotas: Quotas, now: float) -> list[QuotaCheck]:
    """The configured quotas of `tenant` for the periods that contain `now`."""
    day, month, d_end, m_end = periods(now)
    table = [
        ("tokens_per_day", quotas.tokens_per_day, "tokens", f"d:{day}", d_end),
        ("requests_per_day", quotas.requests_per_day, "requests", f"d:{day}", d_end),
        ("tokens_per_month", quotas.tokens_per_month, "tokens", f"m:{month}", m_end),
        ("requests_per_month", quotas.requests_per_month, "requests", f"m:{month}", m_end),
    ]
    return [
        QuotaCheck(name, limit, unit, f"q:{tenant}:{unit}:{period}", end)
        for name, limit, unit, period, end in table
        if limit is not None
    ]
