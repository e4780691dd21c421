"""The console's money: a key's daily budget from the key form, its own limits and budget in the keys
table, spend beside requests and tokens on the tenants page, and a bad budget refused with a 400."""

from __future__ import annotations

import re

from tests.console.conftest import infer
from tests.console.test_console_http import csrf_of, signed_in


def test_a_key_with_a_daily_budget_from_the_form(console_gateway) -> None:  # type: ignore[no-untyped-def]
    with signed_in(console_gateway.ui) as client:
        form = {"tenant": "acme", "name": "budgeted", "budget_usd_per_day": "0.5", "_csrf": csrf_of(client)}
        r = client.post("/keys", data=form)
        assert r.status_code == 201, r.text
        secret = re.search(r'id="new-secret"[^>]*>([^<]+)<', r.text).group(1)  # type: ignore[union-attr]
        key_id = secret.split("-")[1]
        own = re.search(rf'id="key-{key_id}".*?class="own">(.*?)</td>', client.get("/keys").text, re.S)
        assert own is not None and "usd_per_day 0.5" in own.group(1)
        assert infer(console_gateway.url, secret).status_code == 200  # unpriced models cost nothing
        bad = client.post("/keys", data={**form, "budget_usd_per_day": "-2", "_csrf": csrf_of(client)})
        assert bad.status_code == 400 and "budget_usd_per_day" in bad.text
        tenants = client.get("/tenants").text
        assert "Spend USD (month)" in tenants and "<dt>Budget</dt>" in tenants
