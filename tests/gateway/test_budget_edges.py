"""Budgets at their edges through a running gateway: a budget smaller than one micro-USD (the
store's unit) is a budget of one micro-USD, never a zero that divides the used ratio (a 500)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import create_key
from tests.servers import serve_app

ROW = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]}


def test_a_budget_below_one_micro_usd_is_one_micro_usd(digits: Any) -> None:  # noqa: ANN401
    yaml = f"""
state: {{url: "memory://"}}
tenants: {{t: {{budget: {{usd_per_day: 0.0000001}}}}}}
deployments:
  a: {{backend: onnxruntime, model: {digits.onnx_path}}}
  b: {{backend: onnxruntime, model: {digits.onnx_path}}}
models:
  free: {{routes: [{{deployment: a}}]}}
  priced: {{routes: [{{deployment: b}}], pricing: {{usd_per_row: 0.000001}}}}
"""
    with serve_app(create_app(parse_config(yaml, base_dir=Path(".")))) as url:
        headers = {"Authorization": f"Bearer {create_key(url, 't')}"}
        free = httpx.post(f"{url}/v2/models/free/infer", json=ROW, headers=headers)
        assert free.status_code == 200, free.text
        # one micro-USD: the budget holds exactly one priced row, then refuses with its reason
        first = httpx.post(f"{url}/v2/models/priced/infer", json=ROW, headers=headers)
        assert first.status_code == 200, first.text
        second = httpx.post(f"{url}/v2/models/priced/infer", json=ROW, headers=headers)
        assert second.status_code == 429 and "usd_per_day" in second.json()["error"], second.text
