"""Fallback and circuit breaking through the gateway: a dead deployment never fails a caller."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.errors import BackendUnavailable
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import ADMIN_HEADERS, create_key
from tests.servers import serve_app


@pytest.fixture(scope="module")
def fallback_gateway(digits) -> Iterator[tuple[str, str, object]]:  # type: ignore[no-untyped-def]
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{t: {{}}}}
deployments:
  healthy: {{backend: onnxruntime, model: {digits.onnx_path}}}
  also-healthy: {{backend: onnxruntime, model: {digits.onnx_path}}}
models:
  digits:
    routes: [{{deployment: healthy, weight: 50}}, {{deployment: also-healthy, weight: 50}}]
    sticky: none
""",
        base_dir=Path("."),
    )
    app = create_app(config)
    with serve_app(app) as url:
        yield url, create_key(url, "t"), app


def test_all_requests_succeed_when_one_route_goes_away(fallback_gateway, digits):
    """One route starts failing under load: every request is still answered, by the other route,
    and after five consecutive failures its circuit opens so it is no longer tried first."""
    url, key, app = fallback_gateway
    core = app.state.core
    body = {"instances": [[0.0] * 64]}
    headers = {"Authorization": f"Bearer {key}"}
    served = set()
    with httpx.Client(headers=headers) as client:

        def ask() -> None:
            r = client.post(f"{url}/v1/models/digits:predict", json=body)
            assert r.status_code == 200, r.text
            served.add(r.headers["x-fleetgate-deployment"].split(";")[0])

        # each request picks a route at random (50/50, no sticky key): ask until both have served
        # (a fixed ten before the outage failed when all ten went to also-healthy: one time in 1,024)
        for _ in range(100):
            ask()
            if served == {"healthy", "also-healthy"}:
                break
        assert served == {"healthy", "also-healthy"}

        # failure injection: the runtime behind "healthy" starts answering 503
        async def unavailable(request):  # type: ignore[no-untyped-def]
            raise BackendUnavailable("injected outage")

        core.deployments["healthy"].backend.infer = unavailable
        served.clear()
        for _ in range(30):
            ask()
    assert served == {"also-healthy"}
    assert core.breakers.state("healthy") == "open"
    metrics = httpx.get(f"{url}/metrics", headers=ADMIN_HEADERS).text
    assert 'fleetgate_circuit_opened_total{deployment="healthy"} 1.0' in metrics


def _fallbacks_counted(url: str, model: str, source: str, target: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=ADMIN_HEADERS).text
    wanted = {"model": model, "from_deployment": source, "to_deployment": target}
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "fleetgate_fallbacks_total" and sample.labels == wanted
    )


def test_a_fallback_that_answers_everything_is_counted_every_time(digits) -> None:  # type: ignore[no-untyped-def]
    """The primary's circuit opens, so every later plan starts at the declared fallback: each
    request it answers is still counted as a fallback (it was not, once the primary was skipped)."""
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{t: {{}}}}
deployments:
  counted-primary: {{backend: onnxruntime, model: {digits.onnx_path}}}
  counted-spare: {{backend: onnxruntime, model: {digits.onnx_path}}}
models:
  counted-digits: {{routes: [{{deployment: counted-primary}}], fallback: [counted-spare]}}
""",
        base_dir=Path("."),
    )
    app = create_app(config)
    with serve_app(app) as url:
        core = app.state.core

        async def unavailable(request):  # type: ignore[no-untyped-def]
            raise BackendUnavailable("injected outage")

        core.deployments["counted-primary"].backend.infer = unavailable
        headers = {"Authorization": f"Bearer {create_key(url, 't')}"}
        with httpx.Client(headers=headers) as client:
            for _ in range(20):
                r = client.post(f"{url}/v1/models/counted-digits:predict", json={"instances": [[0.0] * 64]})
                assert r.status_code == 200, r.text
                assert r.headers["x-fleetgate-deployment"].split(";")[0] == "counted-spare"
        assert core.breakers.state("counted-primary") == "open"
        assert _fallbacks_counted(url, "counted-digits", "counted-primary", "counted-spare") == 20
