"""Prices, spend and budgets through a running gateway on memory, SQLite and Redis: requests of a known
price stop at the budget with a 429 in the caller's envelope, usage rows carry the spend, a key's own
budget and limits apply beside its tenant's, alerts reach the log, /metrics and a webhook, and gRPC
refuses a spent budget with RESOURCE_EXHAUSTED."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import httpx
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from backends.demo_models.digits import digits_split
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.servers import free_port, serve_app
from tests.tenancy.conftest import ADMIN_HEADERS, admin_create_key, bearer, chat_body, tf_body, v2_body

#: digits: 0.05 USD per row + 0.05 per request, so a one-row request costs exactly 0.10 USD
ROW_REQUEST_USD = 0.10
#: chat: 1000 USD per million prompt tokens (0.001 a token), 2000 per million output tokens
CHAT_IN, CHAT_OUT = 0.001, 0.002


class Hook:
    """A webhook receiver on loopback that keeps what it was POSTed."""

    def __init__(self) -> None:
        self.events: list[dict[str, object]] = []
        received = self.events

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - the standard library's name
                received.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class Gateway:
    def __init__(self, url: str, grpc_target: str, hook: Hook) -> None:
        self.url, self.grpc_target, self.hook = url, grpc_target, hook


@pytest.fixture(scope="module", params=["memory", "sqlite", "redis"])
def gw(request, digits, upstream_url, tmp_path_factory) -> Iterator[Gateway]:  # type: ignore[no-untyped-def]
    if request.param == "memory":
        state = "memory://"
    elif request.param == "sqlite":
        state = f"sqlite:///{tmp_path_factory.mktemp('budgets') / 'state.db'}"
    else:
        state = f"{request.getfixturevalue('redis_url')}?prefix=budgets{uuid.uuid4().hex[:8]}:"
    hook = Hook()
    grpc_port = free_port()
    text = f"""
server: {{grpc_port: {grpc_port}}}
state: {{url: "{state}"}}
admin: {{public_metrics: true}}
budget_alerts: {{thresholds: [0.5, 1.0], webhook_url: "{hook.url}"}}
tenants:
  payer: {{models: ["digits", "chat"], budget: {{usd_per_day: 1.0}}}}
  chatty: {{models: ["chat"]}}
  keyed: {{models: ["digits"]}}
deployments:
  digits:
    backend: onnxruntime
    model: {digits.onnx_path}
    pricing: {{usd_per_row: 0.05, usd_per_request: 0.05}}
  echo:
    backend: remote
    url: {upstream_url}
    protocol: openai
    model_name: echo-upstream
    api_key_env: TEST_UPSTREAM_KEY
models:
  digits: {{routes: [{{deployment: digits}}], pricing: {{usd_per_request: 99}}}}
  chat:
    routes: [{{deployment: echo}}]
    pricing: {{input_usd_per_mtok: 1000, output_usd_per_mtok: 2000}}
"""
    with serve_app(create_app(parse_config(text, base_dir=Path(".")))) as url:
        yield Gateway(url, f"127.0.0.1:{grpc_port}", hook)
    hook.server.shutdown()


def _usage(url: str, tenant: str) -> list[dict[str, object]]:
    r = httpx.get(f"{url}/admin/usage", params={"tenant": tenant}, headers=ADMIN_HEADERS)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _day(rows: list[dict[str, object]], model: str) -> dict[str, object]:
    (row,) = [r for r in rows if r["model"] == model and len(str(r["period"])) == len("2026-11-21")]
    return row


def _wait_for(check, timeout_s: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _metric(url: str, line_start: str) -> float:
    """A sample's value on /metrics (0 when absent). The registry is the process's: the gateways
    of the three stores add to the same samples, so tests compare before and after."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


ALERT = 'fleetgate_budget_alerts_total{budget="usd_per_day",owner="tenant",tenant="payer",threshold="0.5"}'
SPEND = 'fleetgate_spend_usd_total{model="digits",tenant="payer"}'


def test_spend_stops_at_the_budget_in_each_protocols_envelope(gw: Gateway) -> None:
    alerts_before, spend_before = _metric(gw.url, ALERT), _metric(gw.url, SPEND)
    key, _ = admin_create_key(gw.url, "payer")
    answered = 0
    for _ in range(10):  # 10 x 0.10 USD: the deployment's price wins over the model's 99 USD
        r = httpx.post(f"{gw.url}/v2/models/digits/infer", json=v2_body(), headers=bearer(key), timeout=30)
        assert r.status_code == 200, r.text
        answered += 1
    v2 = httpx.post(f"{gw.url}/v2/models/digits/infer", json=v2_body(), headers=bearer(key), timeout=30)
    assert v2.status_code == 429, v2.text
    message = v2.json()["error"]
    assert "usd_per_day" in message and "tenant 'payer'" in message and "is spent" in message
    assert "T00:00:00Z" in message and int(v2.headers["retry-after"]) > 0
    tf = httpx.post(f"{gw.url}/v1/models/digits:predict", json=tf_body(), headers=bearer(key), timeout=30)
    assert tf.status_code == 429 and "usd_per_day" in tf.json()["error"]
    chat = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("chat"), headers=bearer(key), timeout=30)
    assert chat.status_code == 429
    error = chat.json()["error"]
    assert error["code"] == "budget_exceeded" and error["type"] == "rate_limit_error"
    row = _day(_usage(gw.url, "payer"), "digits")
    assert row["requests"] == answered and row["cost_usd"] == pytest.approx(answered * ROW_REQUEST_USD, abs=1e-9)
    # the alerts: 0.5 and 1.0 of the day, once each, to the webhook and /metrics
    _wait_for(lambda: len(gw.hook.events) >= 2)
    assert sorted(e["threshold"] for e in gw.hook.events if e["tenant"] == "payer") == [0.5, 1.0]
    assert _metric(gw.url, ALERT) == alerts_before + 1
    assert _metric(gw.url, SPEND) == pytest.approx(spend_before + 1.0)
    assert _metric(gw.url, 'fleetgate_budget_used_ratio{budget="usd_per_day",tenant="payer"}') == 1.0


def test_a_spent_budget_is_resource_exhausted_over_grpc(gw: Gateway) -> None:
    key, _ = admin_create_key(gw.url, "payer")  # the tenant's budget is shared: spent by the test above
    for _ in range(10):
        httpx.post(f"{gw.url}/v2/models/digits/infer", json=v2_body(), headers=bearer(key), timeout=30)
    with grpc.insecure_channel(gw.grpc_target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="digits")
        tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 64])
        tensor.contents.fp32_contents.extend(digits_split()[1][0].tolist())
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, metadata=(("authorization", f"Bearer {key}"),))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "usd_per_day" in (info.value.details() or "")


def test_a_chat_is_charged_at_its_reported_usage(gw: Gateway) -> None:
    key, key_id = admin_create_key(gw.url, "chatty")
    spent = 0.0
    for _ in range(3):
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=chat_body("chat"), headers=bearer(key), timeout=30)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        spent += usage["prompt_tokens"] * CHAT_IN + usage["completion_tokens"] * CHAT_OUT
    assert spent > 0
    assert _day(_usage(gw.url, "chatty"), "chat")["cost_usd"] == pytest.approx(spent, abs=1e-9)
    # per key: the key, the model asked for and the deployment that served it
    r = httpx.get(f"{gw.url}/admin/usage", params={"tenant": "chatty", "by": "key"}, headers=ADMIN_HEADERS)
    assert r.status_code == 200, r.text
    (day,) = [row for row in r.json()["usage"] if len(row["period"]) == len("2026-11-21")]
    assert (day["key_id"], day["model"], day["deployment"], day["requests"]) == (key_id, "chat", "echo", 3)
    assert day["cost_usd"] == pytest.approx(spent, abs=1e-9)
    bad = httpx.get(f"{gw.url}/admin/usage", params={"by": "colour"}, headers=ADMIN_HEADERS)
    assert bad.status_code == 400 and "by must be model or key" in bad.json()["error"]


def test_a_keys_own_budget_and_limits_beside_its_tenants(gw: Gateway) -> None:
    budgeted, key_id = admin_create_key(gw.url, "keyed", budget={"usd_per_day": 0.2})
    for _ in range(2):
        r = httpx.post(f"{gw.url}/v2/models/digits/infer", json=v2_body(), headers=bearer(budgeted), timeout=30)
        assert r.status_code == 200, r.text
    r = httpx.post(f"{gw.url}/v2/models/digits/infer", json=v2_body(), headers=bearer(budgeted), timeout=30)
    assert r.status_code == 429 and f"key {key_id}" in r.json()["error"]
    limited, limited_id = admin_create_key(gw.url, "keyed", limits={"requests_per_minute": 2})
    for _ in range(2):
        r = httpx.post(f"{gw.url}/v2/models/digits/infer", json=v2_body(), headers=bearer(limited), timeout=30)
        assert r.status_code == 200 and r.headers["x-ratelimit-limit-requests"] == "2"
    r = httpx.post(f"{gw.url}/v2/models/digits/infer", json=v2_body(), headers=bearer(limited), timeout=30)
    assert r.status_code == 429 and f"key {limited_id}" in r.json()["error"] and "retry-after" in r.headers
    listed = httpx.get(f"{gw.url}/admin/keys", params={"tenant": "keyed"}, headers=ADMIN_HEADERS).json()["keys"]
    policies = {k["key_id"]: (k["budget"], k["limits"]) for k in listed}
    assert policies[key_id][0] == {"usd_per_day": 0.2, "usd_per_month": None}
    assert policies[limited_id][1]["requests_per_minute"] == 2


def test_a_bad_key_budget_is_a_400(gw: Gateway) -> None:
    r = httpx.post(
        f"{gw.url}/admin/keys", json={"tenant": "keyed", "budget": {"usd_per_day": -1}}, headers=ADMIN_HEADERS
    )
    assert r.status_code == 400 and "usd_per_day" in r.text, r.text
