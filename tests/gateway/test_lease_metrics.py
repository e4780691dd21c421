"""The lease path on /metrics: requests admitted from memory and top-ups counted through a running
gateway on SQLite (policies/leases/metrics.py, docs/state.md "Watching leases")."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.demo_models.digits import DigitsModel
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import ADMIN_HEADERS, create_key
from tests.servers import serve_app

V2_BODY = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]}
NAMES = (
    "fleetgate_lease_local_admits_total",
    "fleetgate_lease_topups_total",
    "fleetgate_lease_partition_admits_total",
)


def _scrape(url: str) -> dict[str, float]:
    """The lease counters and the settles-pending gauge (per strategy) as /metrics shows them."""
    text = httpx.get(f"{url}/metrics", headers=ADMIN_HEADERS).text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in NAMES:
                found[s.name] = s.value
            elif s.name == "fleetgate_state_settles_pending":
                found[f"pending_{s.labels['strategy']}"] = s.value
    return found


def test_lease_counters_move_on_metrics(digits: DigitsModel, tmp_path: Path) -> None:
    yaml = f"""
state: {{url: "sqlite:///{tmp_path / 'state.db'}", leases: {{strategy: leases}}}}
tenants:
  acme: {{limits: {{requests_per_minute: 6000}}, quotas: {{requests_per_day: 100000}}}}
deployments:
  ort: {{backend: onnxruntime, model: {digits.onnx_path}}}
models:
  digits: {{routes: [{{deployment: ort}}]}}
"""
    config = parse_config(yaml, base_dir=Path("."))
    with serve_app(create_app(config)) as url:
        key = create_key(url, "acme")
        before = _scrape(url)
        assert set(NAMES) <= set(before)  # declared (at zero) before any request takes the path
        with httpx.Client() as client:
            for _ in range(30):
                answer = client.post(
                    f"{url}/v2/models/digits/infer", json=V2_BODY, headers={"Authorization": f"Bearer {key}"}
                )
                assert answer.status_code == 200, answer.text
        after = _scrape(url)
    local = after[NAMES[0]] - before[NAMES[0]]
    topups = after[NAMES[1]] - before[NAMES[1]]
    assert topups >= 1  # the first request found no slice: one store acquire took them
    assert local > 0  # the next ones came from memory
    # no concurrency limit: each request is admitted either from memory or by its own top-up
    assert local + topups == 30
    assert after[NAMES[2]] == before[NAMES[2]]  # the store never went away
    assert after.get("pending_leases", 0.0) == pytest.approx(0.0)


@pytest.mark.slow
def test_lease_counters_sum_every_worker(digits: DigitsModel, tmp_path: Path) -> None:
    """`server.workers: 2`: /metrics, served by one worker, counts every worker's admissions."""
    from tests.tenancy.conftest import admin_create_key, gateway_processes, write_config

    config = write_config(
        tmp_path / "workers.yaml",
        f"""
server: {{workers: 2}}
state: {{url: "sqlite:///{tmp_path / 'state.db'}"}}
tenants: {{acme: {{limits: {{requests_per_minute: 6000}}}}}}
deployments: {{ort: {{backend: onnxruntime, model: {digits.onnx_path}}}}}
models: {{digits: {{routes: [{{deployment: ort}}]}}}}
""",
    )
    with gateway_processes([config], tmp_path) as (gw,):
        key, _ = admin_create_key(gw.url, "acme")
        for _ in range(40):
            with httpx.Client() as client:  # a new connection each time: the kernel spreads them over both workers
                answer = client.post(
                    f"{gw.url}/v2/models/digits/infer", json=V2_BODY, headers={"Authorization": f"Bearer {key}"}
                )
                assert answer.status_code == 200, answer.text
        seen = [_scrape(gw.url) for _ in range(4)]  # whichever worker answers the scrape
    for found in seen:
        assert found[NAMES[0]] + found[NAMES[1]] == 40  # each request counted once, in its own worker
        assert found[NAMES[1]] >= 1
