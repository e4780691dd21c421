"""The console's money: a key's daily budget from the key form, its own limits and budget in the keys
table, spend beside requests and tokens on the tenants page, and a bad budget refused with a 400."""

from __future__ import annotations

import re

from tests.gateway.admin.console.conftest import infer
from tests.gateway.admin.console.test_console_http import csrf_of, signed_in


def test_a_key_with_a_daily_budget_from_the_form(console_gateway) -> None:  # type: ignore[no-untyped-def]
    with signed_in(console_gateway.ui) as client:
        form = {"tenant": "acme", "name": "budgeted", "budget_usd_per_day": "0.5", "_csrf": csrf_of(client)}
        r = client.post("/keys", data=form)
        assert r.status_code == 201, r.text
        secret = re.search(r'id="new-secret"[^>]*>([^<]+)<', r.text).group(1)  # type: ignore[union-attr]
        key_id = secret.split("-")[1]
        page = client.get("/keys").text
        own = re.search(rf'id="key-{key_id}".*?class="own">(.*?)</td>', page, re.S)
        assert own is not None and "usd_per_day 0.5" in own.group(1)
        assert re.search(rf'id="key-{key_id}".*?class="spend">0 / 0</td>', page, re.S)
        assert infer(console_gateway.url, secret).status_code == 200  # unpriced models cost nothing
        bad = client.post("/keys", data={**form, "budget_usd_per_day": "-2", "_csrf": csrf_of(client)})
        assert bad.status_code == 400 and "budget_usd_per_day" in bad.text
        tenants = client.get("/tenants").text
        assert "Spend USD (month)" in tenants and "<dt>Budget</dt>" in tenants


def test_each_keys_spend_this_month_and_today() -> None:
    from datetime import UTC, datetime

    from gateway.admin.console.views import key_spend
    from policies.types import KeyUsageRow

    def row(key: str, period: str, usd: float) -> KeyUsageRow:
        return KeyUsageRow(
            tenant="acme", key_id=key, model="m", deployment="d", period=period, requests=1, tokens=1, cost_usd=usd
        )

    rows = [row("a", "2026-11-27", 0.25), row("a", "2026-11", 1.5), row("b", "2026-10", 9.0), row("b", "2026-10-31", 9.0)]
    rows.append(row("a", "2026-11-02", 0.125))
    spend = key_spend(rows, datetime(2026, 11, 27, 12, tzinfo=UTC))
    assert (spend["a"]["month"], spend["a"]["today"]) == (1.5, 0.25)
    assert "b" not in spend  # nothing this month
    # spend over time: a bar on each day with spend (3 units a day), the dearest day full height
    assert spend["a"]["bars"] == [{"x": 3, "y": 8, "height": 8}, {"x": 78, "y": 0, "height": 16}]


def test_spend_per_day_this_month_sums_each_days_models() -> None:
    from gateway.admin.console.views import _chart, daily
    from policies.types import UsageRow

    def row(model: str, period: str, usd: float, tenant: str = "acme") -> UsageRow:
        return UsageRow(tenant=tenant, model=model, period=period, requests=1, tokens=10, cost_usd=usd)

    rows = [
        row("a", "2026-11", 9.0),  # the month's own row: not a day
        row("a", "2026-11-03", 0.25), row("b", "2026-11-03", 0.5), row("a", "2026-11-01", 0.000004),
        row("a", "2026-10-31", 7.0),  # last month
        row("a", "2026-11-02", 1.0, tenant="other"),
    ]  # fmt: skip
    days = daily(rows, "2026-11")
    assert [(d["model"], d["cost_usd"], d["requests"]) for d in days["acme"]] == [
        ("2026-11-01", 0.000004, 1), ("2026-11-03", 0.75, 2)
    ]  # fmt: skip
    bars = _chart(days["acme"])
    assert [b["unit"] for b in bars] == ["USD", "USD"] and bars[1]["width"] > bars[0]["width"]


def test_the_tenants_page_charts_each_day_of_the_month(console_gateway) -> None:  # type: ignore[no-untyped-def]
    from datetime import UTC, datetime

    from tests.conftest import create_key

    assert infer(console_gateway.url, create_key(console_gateway.url, "acme")).status_code == 200
    with signed_in(console_gateway.ui) as client:
        page = client.get("/tenants").text
    chart = re.search(r'<section class="card tenant" id="tenant-acme">.*?<svg class="chart days"(.*?)</svg>', page, re.S)
    assert chart is not None and "per day this month" in chart.group(1)
    assert datetime.now(UTC).strftime("%Y-%m-%d") in chart.group(1)


def test_priced_spend_is_charted_per_day_for_tenants_and_keys(digits, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from datetime import UTC, datetime

    from gateway.config import parse_config
    from gateway.http.app import create_app
    from tests.conftest import create_key
    from tests.gateway.admin.console.conftest import console_yaml
    from tests.servers import serve_app

    yaml = console_yaml(digits.onnx_path, tmp_path / "state.db").replace(
        f"digits-a: {{backend: onnxruntime, model: {digits.onnx_path}}}",
        f"digits-a: {{backend: onnxruntime, model: {digits.onnx_path}, pricing: {{usd_per_row: 0.003}}}}",
    )
    with serve_app(create_app(parse_config(yaml, base_dir=tmp_path))) as url:
        secret = create_key(url, "acme")
        assert infer(url, secret, "digits-shadowed").status_code == 200  # served by digits-a
        with signed_in(f"{url}/admin/ui") as client:
            tenants, keys = client.get("/tenants").text, client.get("/keys").text
    days = re.search(r'<svg class="chart days"(.*?)</svg>', tenants, re.S)
    assert days is not None and datetime.now(UTC).strftime("%Y-%m-%d") in days.group(1)
    assert "0.003000 USD" in days.group(1)  # six decimals: with one it read 0.0 USD
    row = re.search(rf'id="key-{secret.split("-")[1]}"(.*?)</tr>', keys, re.S)
    assert row is not None and '<svg class="chart spark"' in row.group(1) and 'height="16"' in row.group(1)
