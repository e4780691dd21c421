"""Partial faults stay partial: an upstream down at start-up is served around, then served once it is up."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx

from backends.demo_models.digits import DigitsModel
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import ADMIN_HEADERS, ADMIN_KEY, create_key
from tests.servers import free_port, serve_app

ROW = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]}


def _edge_config(digits: DigitsModel, state: Path):  # type: ignore[no-untyped-def]
    return parse_config(
        f"""
state: {{url: "sqlite:///{state}"}}
tenants: {{front: {{}}}}
deployments: {{digits: {{backend: onnxruntime, model: {digits.onnx_path}}}}}
models: {{digits: {{routes: [{{deployment: digits}}]}}}}
""",
        base_dir=Path("."),
    )


def _front_config(digits: DigitsModel, edge_port: int, readiness: str):  # type: ignore[no-untyped-def]
    return parse_config(
        f"""
server: {{readiness: {readiness}}}
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments:
  local: {{backend: onnxruntime, model: {digits.onnx_path}}}
  edge: {{backend: remote, url: "http://127.0.0.1:{edge_port}", protocol: kserve_v2, model_name: digits,
          api_key_env: TEST_EDGE_KEY}}
models:
  digits: {{routes: [{{deployment: local}}]}}
  edge-digits: {{routes: [{{deployment: edge}}], fallback: [local]}}
  edge-only: {{routes: [{{deployment: edge}}]}}
""",
        base_dir=Path("."),
    )


def _wait_for(check, timeout_s: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def test_upstream_down_at_start_is_served_around_then_served_when_up(digits, tmp_path) -> None:
    edge_port, state = free_port(), tmp_path / "edge.db"
    with serve_app(create_app(_edge_config(digits, state)), port=edge_port) as edge_url:
        os.environ["TEST_EDGE_KEY"] = create_key(edge_url, "front")  # kept in the edge's SQLite state
    # the edge is down now; the front starts anyway
    with serve_app(create_app(_front_config(digits, edge_port, "any"))) as url:
        key = create_key(url, "acme")
        auth = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{url}/health/ready").status_code == 200
        detail = httpx.get(f"{url}/health/ready", headers=ADMIN_HEADERS).json()
        assert detail["deployments"]["edge"]["ready"] is False and detail["deployments"]["edge"]["error"]
        assert httpx.post(f"{url}/v2/models/digits/infer", json=ROW, headers=auth).status_code == 200
        fallback = httpx.post(f"{url}/v2/models/edge-digits/infer", json=ROW, headers=auth)
        assert fallback.status_code == 200 and fallback.headers["x-fleetgate-deployment"].startswith("local")
        assert httpx.post(f"{url}/v2/models/edge-only/infer", json=ROW, headers=auth).status_code == 503
        with serve_app(create_app(_edge_config(digits, state)), port=edge_port):
            # retried with backoff in the background: no restart, no reload
            assert _wait_for(
                lambda: httpx.get(f"{url}/health/ready", headers=ADMIN_HEADERS).json()["deployments"]["edge"][
                    "ready"
                ]
            )
            served = httpx.post(f"{url}/v2/models/edge-only/infer", json=ROW, headers=auth)
            assert served.status_code == 200 and served.headers["x-fleetgate-deployment"].startswith("edge")


def test_readiness_all_waits_for_every_deployment(digits) -> None:
    with serve_app(create_app(_front_config(digits, free_port(), "all"))) as url:
        assert httpx.get(f"{url}/health/ready").status_code == 503
        assert httpx.get(f"{url}/v2/health/ready").status_code == 503


def _echo_config(upstream_url: str, options: str = "{}"):  # type: ignore[no-untyped-def]
    """One tenant, one model on the OpenAI echo upstream (remote backend) with these options."""
    return parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments:
  echo: {{backend: remote, url: "{upstream_url}", protocol: openai, model_name: echo-upstream,
          api_key_env: TEST_UPSTREAM_KEY, options: {options}}}
models: {{echo: {{routes: [{{deployment: echo}}]}}}}
""",
        base_dir=Path("."),
    )


def test_an_upstream_answer_over_max_response_bytes_is_a_502_not_a_buffer(upstream_url) -> None:
    """The echo upstream answers the prompt's words: one 200 kB word makes a 200 kB stream line."""
    with serve_app(create_app(_echo_config(upstream_url, "{max_response_bytes: 100000}"))) as url:
        auth = {"Authorization": f"Bearer {create_key(url, 'acme')}"}
        small = httpx.post(
            f"{url}/v1/completions", json={"model": "echo", "prompt": "a b c", "max_tokens": 3}, headers=auth
        )
        assert small.status_code == 200 and small.json()["choices"][0]["text"] == "c b a"
        huge = httpx.post(
            f"{url}/v1/completions",
            json={"model": "echo", "prompt": "x" * 200_000, "max_tokens": 3},
            headers=auth,
            timeout=30,
        )
        assert huge.status_code == 502, huge.text
        assert huge.json()["error"]["code"] == "upstream_too_large"


def test_remote_streams_reuse_their_upstream_connection(upstream_url) -> None:
    """Each answer is read to its end, so the pool keeps one connection instead of opening one per request."""
    app = create_app(_echo_config(upstream_url))
    with serve_app(app) as url:
        auth = {"Authorization": f"Bearer {create_key(url, 'acme')}"}
        for stream in (False, True, False, True, False):
            r = httpx.post(
                f"{url}/v1/completions",
                json={"model": "echo", "prompt": "a b c", "max_tokens": 3, "stream": stream},
                headers=auth,
            )
            assert r.status_code == 200
        client = app.state.core.deployments["echo"].backend._client
        assert client.connections_opened == 1  # one connection, reused by all five


def test_an_upstream_key_revoked_while_serving_is_served_around(digits, tmp_path) -> None:
    """The edge revokes the front's key mid-traffic: the edge route's answers become 401s from the
    upstream, a fault of that deployment (never the caller's 4xx), so the model's fallback serves."""
    edge_port, state = free_port(), tmp_path / "edge.db"
    with serve_app(create_app(_edge_config(digits, state)), port=edge_port) as edge_url:
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        made = httpx.post(f"{edge_url}/admin/keys", json={"tenant": "front"}, headers=admin).json()
        os.environ["TEST_EDGE_KEY"] = made["key"]
        with serve_app(create_app(_front_config(digits, edge_port, "any"))) as url:
            auth = {"Authorization": f"Bearer {create_key(url, 'acme')}"}
            before = httpx.post(f"{url}/v2/models/edge-digits/infer", json=ROW, headers=auth)
            assert before.status_code == 200 and before.headers["x-fleetgate-deployment"].startswith("edge")
            revoked = httpx.delete(f"{edge_url}/admin/keys/{made['key_id']}", headers=admin)
            assert revoked.status_code == 200
            time.sleep(1.2)  # the edge's key cache (<= 1 s)
            for _ in range(8):
                r = httpx.post(f"{url}/v2/models/edge-digits/infer", json=ROW, headers=auth)
                assert r.status_code == 200, r.text
                assert r.headers["x-fleetgate-deployment"].startswith("local")
            only_edge = httpx.post(f"{url}/v2/models/edge-only/infer", json=ROW, headers=auth)
            assert only_edge.status_code == 503  # refused credentials, then an open breaker: never a 4xx or 500
