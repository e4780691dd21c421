"""Prices in integer micro-USD: exact, rounded once per request, the worst case covering the real cost."""

from __future__ import annotations

import msgspec
import pytest

from policies.budgets import Budget, budget_checks, crossed
from policies.pricing import Pricing, Usage, cost_micros, costliest, micros_of, usd, worst_case_micros


def test_a_price_per_million_tokens_is_micro_usd_per_token() -> None:
    p = Pricing(input_usd_per_mtok=0.15, output_usd_per_mtok=0.6, usd_per_request=0.001)
    # 1000 x 0.15 + 500 x 0.6 + 1000 (the request) micro-USD, exactly (0.15 is not a binary float)
    assert cost_micros(p, Usage(input_tokens=1000, output_tokens=500)) == 150 + 300 + 1000


def test_cached_tokens_take_the_cached_price_and_default_to_the_input_price() -> None:
    p = Pricing(input_usd_per_mtok=2.0, cached_input_usd_per_mtok=0.5)
    assert cost_micros(p, Usage(input_tokens=100, cached_tokens=40)) == 60 * 2 + 40 * 0.5
    assert cost_micros(Pricing(input_usd_per_mtok=2.0), Usage(input_tokens=100, cached_tokens=40)) == 200


def test_rows_and_a_failed_request() -> None:
    p = Pricing(usd_per_row=0.0001, usd_per_request=0.01)
    assert cost_micros(p, Usage(rows=3)) == 300 + 10_000
    assert cost_micros(p, Usage(rows=0, requests=0)) == 0


def test_rounding_is_half_up_once_per_request() -> None:
    p = Pricing(input_usd_per_mtok=0.3)
    assert cost_micros(p, Usage(input_tokens=1)) == 0  # 0.3 micro-USD
    assert cost_micros(p, Usage(input_tokens=5)) == 2  # 1.5 -> 2
    assert cost_micros(None, Usage(input_tokens=10**9)) == 0


def test_the_worst_case_covers_every_real_outcome() -> None:
    p = Pricing(input_usd_per_mtok=0.7, output_usd_per_mtok=2.3, usd_per_request=0.0005)
    worst = worst_case_micros(p, input_tokens=37, max_output_tokens=64)
    for out in range(65):
        assert cost_micros(p, Usage(input_tokens=37, output_tokens=out)) <= worst


def test_the_worst_case_covers_a_cached_price_above_the_input_price() -> None:
    p = Pricing(input_usd_per_mtok=1.0, cached_input_usd_per_mtok=3.0, output_usd_per_mtok=2.0)
    worst = worst_case_micros(p, input_tokens=100, max_output_tokens=10)
    for cached in range(101):
        assert cost_micros(p, Usage(input_tokens=100, cached_tokens=cached, output_tokens=10)) <= worst
    assert worst == 100 * 3 + 10 * 2  # it was 100 x 1 + 10 x 2, below a reused prefix's cost


def test_costliest_dominates_each_price() -> None:
    a = Pricing(input_usd_per_mtok=1.0, output_usd_per_mtok=1.0)
    b = Pricing(output_usd_per_mtok=5.0, usd_per_request=0.01)
    top = costliest([a, None, b])
    assert top is not None
    u = Usage(input_tokens=10, output_tokens=10)
    assert cost_micros(top, u) >= max(cost_micros(a, u), cost_micros(b, u))
    assert costliest([None]) is None


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), True])
def test_bad_prices_are_refused_with_their_path(bad: object) -> None:
    with pytest.raises(msgspec.ValidationError, match="input_usd_per_mtok"):
        msgspec.convert({"input_usd_per_mtok": bad}, Pricing)


def test_unknown_price_fields_are_refused() -> None:
    with pytest.raises(msgspec.ValidationError, match="usd_per_token"):
        msgspec.convert({"usd_per_token": 1}, Pricing)


def test_usd_edges() -> None:
    assert micros_of(1.0) == 1_000_000 and micros_of(0.1) == 100_000
    assert usd(1_500_000) == 1.5


def test_budget_checks_and_their_refusal_name_the_budget_what_is_left_and_the_reset() -> None:
    now = 1_764_000_000.0  # 2025-11-24T16:00:00Z
    checks = budget_checks("acme", None, Budget(usd_per_day=1.0, usd_per_month=20), now)
    assert [(c.name, c.limit_micros, c.key) for c in checks] == [
        ("usd_per_day", 1_000_000, "b:t:acme:usd:d:2025-11-24"),
        ("usd_per_month", 20_000_000, "b:t:acme:usd:m:2025-11"),
    ]
    message = checks[0].refusal(used_micros=999_000, cost_micros=5_000)
    assert "usd_per_day" in message and "tenant 'acme'" in message
    assert "0.001000 USD left" in message and "2025-11-25T00:00:00Z" in message
    assert "is spent" in checks[0].refusal(used_micros=1_000_000, cost_micros=1)
    assert budget_checks("x", None, None, now) == []


def test_thresholds_crossed_once_by_a_move() -> None:
    (check,) = budget_checks("acme", None, Budget(usd_per_day=1.0), 0.0)
    (key_check,) = budget_checks("acme", "0123456789ab", Budget(usd_per_day=1.0), 0.0)
    assert key_check.key == "b:k:0123456789ab:usd:d:1970-01-01" and key_check.scope == "key 0123456789ab"
    assert [e.threshold for e in crossed(check, 400_000, 850_000, [0.5, 0.8, 1.0])] == [0.5, 0.8]
    assert crossed(check, 850_000, 900_000, [0.5, 0.8, 1.0]) == []
    assert [e.threshold for e in crossed(check, 900_000, 1_000_000, [0.5, 0.8, 1.0])] == [1.0]


@pytest.mark.parametrize("bad", [0, -1.0, float("inf")])
def test_bad_budgets_are_refused(bad: float) -> None:
    with pytest.raises(msgspec.ValidationError, match="usd_per_day"):
        msgspec.convert({"usd_per_day": bad}, Budget)
