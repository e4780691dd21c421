"""`server.request_timeout_s` ends a request that runs too long with the protocol's 504, and frees what it held."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.demo_models.digits import DigitsModel
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import create_key
from tests.servers import serve_app

TIMEOUT_S = 0.5
ROW = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]}


@pytest.fixture(scope="module")
def slow_gateway(digits: DigitsModel) -> Iterator[tuple[str, str, dict[str, float]]]:
    config = parse_config(
        f"""
server: {{request_timeout_s: {TIMEOUT_S}}}
state: {{url: "memory://"}}
tenants: {{t: {{limits: {{max_concurrency: 1}}}}}}
deployments: {{digits: {{backend: onnxruntime, model: {digits.onnx_path}}}}}
models: {{digits: {{routes: [{{deployment: digits}}]}}}}
""",
        base_dir=Path("."),
    )
    app = create_app(config)
    delay = {"s": 0.0}
    with serve_app(app) as url:
        backend = app.state.core.deployments["digits"].backend
        infer = backend.infer

        async def slowed(request):  # type: ignore[no-untyped-def]  # failure injection: a hung runtime
            await asyncio.sleep(delay["s"])
            return await infer(request)

        backend.infer = slowed
        yield url, create_key(url, "t"), delay


@pytest.mark.parametrize(
    ("path", "body", "protocol"),
    [
        ("/v2/models/digits/infer", ROW, "v2"),
        ("/v1/models/digits:predict", {"instances": [[0.0] * 64]}, "tfserving"),
    ],
)
def test_a_request_past_its_deadline_gets_504_and_releases_its_lease(slow_gateway, path, body, protocol) -> None:
    url, key, delay = slow_gateway
    auth = {"Authorization": f"Bearer {key}"}
    delay["s"] = 5.0
    r = httpx.post(f"{url}{path}", json=body, headers=auth, timeout=10)
    assert r.status_code == 504, r.text
    assert "request_timeout_s" in r.json()["error"]
    delay["s"] = 0.0
    # max_concurrency 1: the timed-out request's lease was released, so the next one is admitted
    # (a lease still held answers 429). A machine stall past the 0.5 s deadline answers another
    # 504, which also proves admission (seen once under a full test run: 1.4 s), so try thrice.
    statuses = []
    while len(statuses) < 3 and 200 not in statuses:
        statuses.append(httpx.post(f"{url}{path}", json=body, headers=auth, timeout=10).status_code)
    assert 200 in statuses and set(statuses) <= {200, 504}, statuses
