"""Shadow traffic through the gateway: off the caller's path, compared, exported per pair.

The primary is a real ONNX Runtime deployment; the shadows are real ONNX Runtime deployments whose
runtime gets a wrapper (test doubles only for the slowness, the perturbation and the failures). The
text shadows are `remote` deployments in front of the OpenAI upstream of tests/openai_upstream.py.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from backends.base import Tensor, TensorResponse, TokenEvent
from backends.demo_models.digits import digits_split
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import ADMIN_HEADERS, create_key
from tests.servers import serve_app

log = structlog.get_logger(__name__)
SHADOW_SLEEP_S = 0.2
PERTURBATION = 0.01


def _yaml(model: Path, upstream: str) -> str:
    remote = f"{{backend: remote, url: {upstream}, protocol: openai, model_name: echo-upstream, api_key_env: TEST_UPSTREAM_KEY}}"
    return f"""
state: {{url: "memory://"}}
tenants: {{t: {{limits: {{requests_per_minute: 100000}}, quotas: {{requests_per_month: 100000}}}}}}
deployments:
  primary: {{backend: onnxruntime, model: {model}}}
  slow-shadow: {{backend: onnxruntime, model: {model}}}
  broken-shadow: {{backend: onnxruntime, model: {model}}}
  shape-shadow: {{backend: onnxruntime, model: {model}}}
  echo: {remote}
  echo-same: {remote}
  echo-diff: {remote}
models:
  digits: {{routes: [{{deployment: primary}}], shadow: {{deployment: slow-shadow, fraction: 1.0}}}}
  digits-plain: {{routes: [{{deployment: primary}}]}}
  digits-broken: {{routes: [{{deployment: primary}}], shadow: {{deployment: broken-shadow}}}}
  digits-shape: {{routes: [{{deployment: primary}}], shadow: {{deployment: shape-shadow}}}}
  echo-a: {{routes: [{{deployment: echo}}], shadow: {{deployment: echo-same}}}}
  echo-b: {{routes: [{{deployment: echo}}], shadow: {{deployment: echo-diff}}}}
"""


@dataclass
class Env:
    url: str
    key: str

    def client(self) -> httpx.Client:
        return httpx.Client(headers={"Authorization": f"Bearer {self.key}"}, timeout=30)

    def metric(self, name: str, **labels: str) -> float | None:
        for family in text_string_to_metric_families(
            httpx.get(f"{self.url}/metrics", headers=ADMIN_HEADERS).text
        ):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None

    def wait_metric(self, name: str, value: float, timeout_s: float = 15.0, **labels: str) -> None:
        deadline = time.monotonic() + timeout_s
        while (seen := self.metric(name, **labels)) != value:
            assert time.monotonic() < deadline, f"{name}{labels} is {seen}, expected {value}"
            time.sleep(0.05)


def _install_doubles(core: Any) -> None:
    deps = core.deployments

    slow = deps["slow-shadow"].backend
    slow_infer = slow.infer

    async def slow_and_perturbed(request: Any) -> TensorResponse:
        await asyncio.sleep(SHADOW_SLEEP_S)
        answer = await slow_infer(request)
        outputs = [
            Tensor.from_array(t.name, t.data + np.float32(PERTURBATION)) if t.data.dtype.kind == "f" else t
            for t in answer.outputs
        ]
        return TensorResponse(id=answer.id, outputs=outputs)

    slow.infer = slow_and_perturbed

    async def broken(request: Any) -> TensorResponse:
        raise RuntimeError("the shadow blew up")

    deps["broken-shadow"].backend.infer = broken

    shape = deps["shape-shadow"].backend
    shape_infer = shape.infer

    async def drops_an_output(request: Any) -> TensorResponse:
        answer = await shape_infer(request)
        return TensorResponse(id=answer.id, outputs=answer.outputs[:1])

    shape.infer = drops_an_output

    diff = deps["echo-diff"].backend
    diff_generate = diff.generate

    async def first_word_changed(request: Any) -> AsyncIterator[TokenEvent]:
        first = True
        async for event in diff_generate(request):
            if first and event.text:  # the first word, whether events carry a word or the whole text
                _, _, rest = event.text.partition(" ")
                event = msgspec.structs.replace(event, text="CHANGED" + (" " + rest if rest else ""))
                first = False
            yield event

    diff.generate = first_word_changed


@pytest.fixture(scope="module")
def env(digits, upstream_url) -> Iterator[Env]:  # type: ignore[no-untyped-def]
    app = create_app(parse_config(_yaml(digits.onnx_path, upstream_url), base_dir=Path(".")))
    with serve_app(app) as url:
        _install_doubles(app.state.core)
        yield Env(url, create_key(url, "t"))


def _predict(client: httpx.Client, url: str, model: str, row: list[float]) -> float:
    started = time.perf_counter()
    r = client.post(f"{url}/v1/models/{model}:predict", json={"instances": [row]})
    elapsed = time.perf_counter() - started
    assert r.status_code == 200, r.text
    return elapsed


def test_slow_shadow_adds_no_latency_and_its_diffs_are_measured(env: Env):
    """Caller latency with a shadow that sleeps 200 ms vs none, interleaved in one run; then the
    perturbation (+0.01 on every probability) is read back from /metrics."""
    rows = [[float(x) for x in row] for row in digits_split()[1][:40]]
    with_shadow, without = [], []
    with env.client() as client:
        for _ in range(3):  # warm both paths
            _predict(client, env.url, "digits-plain", rows[0])
        for row in rows:
            without.append(_predict(client, env.url, "digits-plain", row))
            with_shadow.append(_predict(client, env.url, "digits", row))
    med_with, med_without = statistics.median(with_shadow), statistics.median(without)
    log.info("shadow_caller_latency", median_with_ms=med_with * 1000, median_without_ms=med_without * 1000)
    # a caller that waited for the shadow would take >= 200 ms; noise on this machine is << 50 ms
    assert med_with < med_without + 0.05

    pair = {"model": "digits", "primary": "primary", "shadow": "slow-shadow"}
    env.wait_metric("fleetgate_shadow_compared_total", len(rows), **pair)
    count = env.metric("fleetgate_shadow_max_abs_diff_count", **pair)
    total = env.metric("fleetgate_shadow_max_abs_diff_sum", **pair)
    assert count == len(rows)
    assert total is not None and total / count == pytest.approx(PERTURBATION, abs=1e-4)
    rel_total = env.metric("fleetgate_shadow_max_rel_diff_sum", **pair)
    assert rel_total is not None and rel_total / count >= PERTURBATION  # |p| <= 1, so rel >= abs
    assert env.metric("fleetgate_shadow_requests_total", outcome="ok", **pair) == len(rows)
    assert env.metric("fleetgate_shadow_shape_mismatch_total", **pair) in (None, 0.0)


def test_failing_shadow_never_fails_the_caller(env: Env):
    with env.client() as client:
        for i in range(10):
            _predict(client, env.url, "digits-broken", [float(i)] * 64)
    pair = {"model": "digits-broken", "primary": "primary", "shadow": "broken-shadow"}
    env.wait_metric("fleetgate_shadow_requests_total", 10, outcome="error", **pair)
    assert env.metric("fleetgate_shadow_compared_total", **pair) in (None, 0.0)


def test_mismatched_shapes_are_counted_apart(env: Env):
    with env.client() as client:
        for i in range(5):
            _predict(client, env.url, "digits-shape", [float(i)] * 64)
    pair = {"model": "digits-shape", "primary": "primary", "shadow": "shape-shadow"}
    env.wait_metric("fleetgate_shadow_shape_mismatch_total", 5, **pair)
    assert env.metric("fleetgate_shadow_compared_total", **pair) in (None, 0.0)


def test_text_shadows_exact_match_and_word_agreement(env: Env):
    prompt = "one two three four"  # the upstream answers "four three two one"
    with env.client() as client:
        for model in ("echo-a", "echo-b"):
            for _ in range(4):
                r = client.post(
                    f"{env.url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 16}
                )
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == "four three two one"
    same = {"model": "echo-a", "primary": "echo", "shadow": "echo-same"}
    diff = {"model": "echo-b", "primary": "echo", "shadow": "echo-diff"}
    env.wait_metric("fleetgate_shadow_compared_total", 4, **same)
    env.wait_metric("fleetgate_shadow_compared_total", 4, **diff)
    assert env.metric("fleetgate_shadow_exact_match_total", **same) == 4
    assert env.metric("fleetgate_shadow_exact_match_total", **diff) == 0
    # words, since the upstream sends no token ids: 3 of 4 positions agree
    assert env.metric("fleetgate_shadow_token_agreement_sum", unit="words", **same) == 4.0
    assert env.metric("fleetgate_shadow_token_agreement_sum", unit="words", **diff) == pytest.approx(3.0)
