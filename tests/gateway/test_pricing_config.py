"""The config's prices, budgets and budget alerts: accepted where documented, refused with their path."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, parse_config
from policies.pricing import Pricing
from policies.types import Budget

BASE = """
deployments:
  d: {{backend: remote, url: "http://127.0.0.1:9", protocol: openai{dep}}}
models:
  m: {{routes: [{{deployment: d}}]{model}}}
tenants:
  t: {{{tenant}}}
{extra}
"""


def _parse(dep: str = "", model: str = "", tenant: str = "", extra: str = ""):  # type: ignore[no-untyped-def]
    return parse_config(BASE.format(dep=dep, model=model, tenant=tenant, extra=extra), base_dir=Path("."), env={})


def test_prices_on_a_model_and_a_deployment_and_a_tenants_budget() -> None:
    config = _parse(
        dep=", pricing: {input_usd_per_mtok: 0.5, output_usd_per_mtok: 1.5}",
        model=", pricing: {usd_per_request: 0.01}",
        tenant="budget: {usd_per_day: 1, usd_per_month: 20}",
        extra="budget_alerts: {thresholds: [0.8], webhook_url: 'https://hooks.example/x'}",
    )
    assert config.deployments["d"].pricing == Pricing(input_usd_per_mtok=0.5, output_usd_per_mtok=1.5)
    assert config.models["m"].pricing == Pricing(usd_per_request=0.01)
    assert config.tenants["t"].budget == Budget(usd_per_day=1, usd_per_month=20)
    assert config.budget_alerts.thresholds == [0.8]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"dep": ", pricing: {input_usd_per_mtok: -1}"}, "$.deployments.d"),
        # beyond what the stores' 64-bit counters can add (a 500 on every priced call before)
        ({"dep": ", pricing: {usd_per_row: 1.0e+300}"}, "usd_per_row must be a number in 0..100000"),
        ({"model": ", pricing: {output_usd_per_mtok: 1.0e+6}"}, "$.models.m"),
        ({"model": ", pricing: {usd_per_request: .nan}"}, "usd_per_request"),
        ({"model": ", pricing: {usd_per_request: .inf}"}, "usd_per_request"),
        ({"model": ", pricing: {usd_per_request: '0.1'}"}, "usd_per_request"),
        ({"model": ", pricing: {usd_per_tokn: 1}"}, "usd_per_tokn"),
        ({"tenant": "budget: {usd_per_day: 0}"}, "usd_per_day"),
        ({"tenant": "budget: {usd_per_week: 5}"}, "usd_per_week"),
        ({"extra": "budget_alerts: {thresholds: [1.5]}"}, "thresholds"),
        ({"extra": "budget_alerts: {webhook_url: 'ftp://x'}"}, "webhook_url"),
        # a URL no request can be made to, refused at start rather than failing at the first event;
        # the message never repeats the URL (it may carry a credential)
        ({"extra": "budget_alerts: {webhook_url: 'https://u:s3cret@hooks.example:99999/x'}"}, "host or port"),
        ({"extra": "budget_alerts: {webhook_url: 'https://'}"}, "must name a host"),
        ({"extra": "budget_alerts: {webhook_url: 'https://hooks example/x'}"}, "must name a host"),
    ],
)
def test_bad_prices_budgets_and_alerts_name_their_path(fields: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        _parse(**fields)
    assert needle in str(err.value) and "s3cret" not in str(err.value)
