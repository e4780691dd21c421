"""Least-expected-wait pools through the gateway: the idle replica takes the load of a saturated one.

Two real ONNX Runtime deployments of the digits model: `busy` has a concurrency budget of one and a
wrapper that adds 30 ms per request (a double for a saturated accelerator), `idle` is plain. Under
eight concurrent callers of one tenant, a `balance: least_wait` pool sends nearly everything to
`idle`; the same routes with the default `weighted` balance keep the tenant sticky on one of them.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import ADMIN_HEADERS, create_key
from tests.servers import serve_app

log = structlog.get_logger(__name__)
BUSY_SERVICE_S = 0.03


def _yaml(model: Path) -> str:
    return f"""
state: {{url: "memory://"}}
tenants: {{t: {{limits: {{requests_per_minute: 100000}}}}}}
deployments:
  busy: {{backend: onnxruntime, model: {model}, device: cpu, hardware: gpu-sim, queue: {{max_concurrency: 1}}}}
  idle: {{backend: onnxruntime, model: {model}, device: cpu, hardware: xeon, queue: {{max_concurrency: 4}}}}
models:
  pooled:
    routes: [{{deployment: busy, weight: 50}}, {{deployment: idle, weight: 50}}]
    balance: least_wait
    sticky: none                # without the pool, half would go to busy
  sticky:
    routes: [{{deployment: busy, weight: 50}}, {{deployment: idle, weight: 50}}]
"""


@pytest.fixture(scope="module")
def pool(digits) -> Iterator[tuple[str, str]]:  # type: ignore[no-untyped-def]
    app = create_app(parse_config(_yaml(digits.onnx_path), base_dir=Path(".")))
    with serve_app(app) as url:
        backend = app.state.core.deployments["busy"].backend
        infer = backend.infer

        async def saturated(request: Any) -> Any:
            await asyncio.sleep(BUSY_SERVICE_S)
            return await infer(request)

        backend.infer = saturated
        yield url, create_key(url, "t")


def _load(url: str, key: str, model: str, n: int = 80, workers: int = 8) -> list[str]:
    """`n` requests from `workers` concurrent callers; the `x-fleetgate-deployment` of each."""
    with httpx.Client(headers={"Authorization": f"Bearer {key}"}, timeout=30) as client:

        def one(i: int) -> str:
            r = client.post(f"{url}/v1/models/{model}:predict", json={"instances": [[float(i % 16)] * 64]})
            assert r.status_code == 200, r.text
            return r.headers["x-fleetgate-deployment"]

        with ThreadPoolExecutor(workers) as pool_:
            return list(pool_.map(one, range(n)))


def test_idle_replica_takes_the_load_of_a_saturated_one(pool):
    url, key = pool
    headers = _load(url, key, "pooled")
    served = Counter(h.split(";")[0] for h in headers)
    assert served["idle"] / len(headers) >= 0.8, served
    log.info("least_wait_share", **served)
    idle_header = next(h for h in headers if h.startswith("idle;"))
    assert "device=cpu" in idle_header and "hardware=xeon" in idle_header

    # weighted (the default) keeps one tenant on one route whatever the load
    sticky = Counter(h.split(";")[0] for h in _load(url, key, "sticky", n=16))
    assert len(sticky) == 1, sticky

    families = {
        f.name: f
        for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", headers=ADMIN_HEADERS).text)
    }
    service = {s.labels["deployment"]: s for s in families["fleetgate_service_time_seconds"].samples}
    assert service["busy"].labels["hardware"] == "gpu-sim" and service["idle"].labels["hardware"] == "xeon"
    assert service["busy"].value >= BUSY_SERVICE_S > service["idle"].value
    waits = {s.labels["deployment"]: s.labels for s in families["fleetgate_expected_wait_seconds"].samples}
    assert waits["idle"]["device"] == "cpu" and waits["busy"]["hardware"] == "gpu-sim"
