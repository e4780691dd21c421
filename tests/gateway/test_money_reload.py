"""A config reload of prices and budgets through a running gateway: a model's new price and a
tenant's new budget apply to the next request; a deployment's new price is refused with its reason
(deployment changes need a restart), the running prices kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from gateway.config import load_config
from gateway.http.app import create_app
from tests.conftest import ADMIN_HEADERS, create_key
from tests.servers import serve_app

ROW = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]}


def _yaml(model: Path, *, row_usd: float, budget_usd: float, dep_pricing: str = "") -> str:
    return f"""
state: {{url: "memory://"}}
tenants: {{t: {{budget: {{usd_per_day: {budget_usd}}}}}}}
deployments:
  a: {{backend: onnxruntime, model: {model}{dep_pricing}}}
models:
  digits: {{routes: [{{deployment: a}}], pricing: {{usd_per_row: {row_usd}}}}}
"""


def _spent(url: str) -> float:
    rows = httpx.get(f"{url}/admin/usage", params={"tenant": "t"}, headers=ADMIN_HEADERS).json()["usage"]
    return round(sum(r["cost_usd"] for r in rows if len(r["period"]) == 10), 6)


def test_a_reload_applies_prices_and_budgets_or_says_why_not(tmp_path: Path, digits: Any) -> None:  # noqa: ANN401
    path = tmp_path / "gw.yaml"
    path.write_text(_yaml(digits.onnx_path, row_usd=0.1, budget_usd=1.0))
    with serve_app(create_app(load_config(path), config_path=path)) as url:
        key = {"Authorization": f"Bearer {create_key(url, 't')}"}
        infer = f"{url}/v2/models/digits/infer"
        assert httpx.post(infer, json=ROW, headers=key).status_code == 200
        assert _spent(url) == 0.1

        # a dearer row and a smaller budget: 0.1 spent + 0.2 of this request > 0.25
        path.write_text(_yaml(digits.onnx_path, row_usd=0.2, budget_usd=0.25))
        assert httpx.post(f"{url}/admin/reload", headers=ADMIN_HEADERS).status_code == 200
        refused = httpx.post(infer, json=ROW, headers=key)
        assert refused.status_code == 429, refused.text
        assert "0.25 USD" in refused.json()["error"]

        path.write_text(_yaml(digits.onnx_path, row_usd=0.2, budget_usd=1.0))
        assert httpx.post(f"{url}/admin/reload", headers=ADMIN_HEADERS).status_code == 200
        assert httpx.post(infer, json=ROW, headers=key).status_code == 200
        assert _spent(url) == 0.3  # charged at the new price

        # a deployment's own price is part of the deployment: refused, and the running price stays
        path.write_text(
            _yaml(digits.onnx_path, row_usd=0.2, budget_usd=1.0, dep_pricing=", pricing: {usd_per_row: 0.5}")
        )
        answer = httpx.post(f"{url}/admin/reload", headers=ADMIN_HEADERS)
        assert answer.status_code == 400 and "deployment changes need a restart" in answer.text, answer.text
        assert httpx.post(infer, json=ROW, headers=key).status_code == 200
        assert _spent(url) == 0.5
