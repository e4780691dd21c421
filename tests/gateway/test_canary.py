"""Canary rollback through the gateway: a candidate that fails 30% of its requests is rolled back.

Baseline and candidate are real ONNX Runtime deployments of the digits model; the candidate's
runtime gets a failure-injecting wrapper (a test double only for the failures). Requests are sent
one at a time, so the number of canary attempts before the rollback is exact. A candidate with a
changed input signature (a real ONNX model built here) refuses every request and is rolled back on
its caller-error rate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.errors import BackendInternalError, BackendUnavailable
from gateway.config import load_config
from gateway.http.app import create_app
from tests.conftest import ADMIN_HEADERS, ADMIN_KEY, create_key
from tests.servers import serve_app

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MIN_REQUESTS = 20
WINDOW_S = 30
FAILURE_RATE = 0.3
BODY = {"instances": [[0.0] * 64]}


def _config(
    model: Path,
    canary: str = "canary: {max_error_rate: 0.1, max_latency_ratio: 5.0, "
    f"window_s: {WINDOW_S}, min_requests: {MIN_REQUESTS}}}",
    weight: int = 30,
) -> str:
    return f"""
state: {{url: "memory://"}}
tenants: {{t: {{}}}}
deployments:
  stable: {{backend: onnxruntime, model: {model}}}
  candidate: {{backend: onnxruntime, model: {model}}}
models:
  digits:
    routes:
      - {{deployment: stable, weight: {100 - weight}}}
      - {{deployment: candidate, weight: {weight}, {canary}}}
    sticky: none
"""


class Injector:
    """Wraps the candidate's runtime: attempts numbered 0, 1, ...; 3 of every 10 fail."""

    def __init__(self, infer: Any) -> None:
        self.infer = infer
        self.attempts = 0
        self.failures = 0
        self.error: type[Exception] | None = None

    async def __call__(self, request: Any) -> Any:
        n = self.attempts
        self.attempts += 1
        if self.error is not None and n % 10 in (1, 4, 7):
            self.failures += 1
            raise self.error("injected failure")
        return await self.infer(request)


@dataclass
class Canary:
    url: str
    key: str
    path: Path
    model: Path
    core: Any
    injector: Injector

    def predict(self, client: httpx.Client) -> httpx.Response:
        return client.post(f"{self.url}/v1/models/digits:predict", json=BODY)

    def metric(self, name: str, **labels: str) -> float | None:
        text = httpx.get(f"{self.url}/metrics", headers=ADMIN_HEADERS).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return None


@pytest.fixture(scope="module")
def canary(digits, tmp_path_factory) -> Iterator[Canary]:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("canary") / "gw.yaml"
    path.write_text(_config(digits.onnx_path))
    app = create_app(load_config(path), config_path=path)
    with serve_app(app) as url:
        core = app.state.core
        backend = core.deployments["candidate"].backend
        injector = Injector(backend.infer)
        backend.infer = injector
        yield Canary(url, create_key(url, "t"), path, digits.onnx_path, core, injector)


@pytest.fixture
def fresh(canary: Canary) -> Canary:
    """Each test starts from the configured file, a restored canary and a clean injector."""
    canary.path.write_text(_config(canary.model))
    assert httpx.post(f"{canary.url}/admin/reload", headers=ADMIN).status_code == 200
    httpx.post(f"{canary.url}/admin/canary/digits/candidate/restore", headers=ADMIN).raise_for_status()
    canary.injector.attempts = canary.injector.failures = 0
    canary.injector.error = None
    return canary


def _until_rollback(c: Canary, limit: int = 400) -> tuple[int, list[int], float]:
    """Send requests until the canary is rolled back: (requests sent, failed statuses, seconds
    from the canary's first attempt to the rollback)."""
    failed: list[int] = []
    first_attempt: float | None = None
    with httpx.Client(headers={"Authorization": f"Bearer {c.key}"}) as client:
        for sent in range(1, limit + 1):
            r = c.predict(client)
            if r.status_code != 200:
                failed.append(r.status_code)
            if first_attempt is None and c.injector.attempts:
                first_attempt = time.monotonic()
            if c.core.router.canaries.rolled_back("digits", "candidate"):
                assert first_attempt is not None
                return sent, failed, time.monotonic() - first_attempt
    raise AssertionError(f"no rollback after {limit} requests")


def test_retryable_canary_failures_roll_it_back_without_failing_a_caller(fresh: Canary):
    c = fresh
    c.injector.error = BackendUnavailable
    before = c.metric("fleetgate_canary_rollbacks_total", deployment="candidate", reason="error_rate") or 0
    sent, failed, seconds = _until_rollback(c)
    # judged at its MIN_REQUESTS-th outcome, where 6 of 20 (30%) had failed: over 0 + 0.1
    assert c.injector.attempts == MIN_REQUESTS and c.injector.failures == 6
    assert seconds < WINDOW_S
    assert failed == [], "every 503 of the canary was retried on the baseline"
    assert (
        c.metric("fleetgate_canary_rollbacks_total", deployment="candidate", reason="error_rate")
        == before + 1
    )
    assert c.metric("fleetgate_route_effective_weight", model="digits", deployment="candidate") == 0.0
    assert c.metric("fleetgate_route_effective_weight", model="digits", deployment="stable") == 70.0
    status = httpx.get(f"{c.url}/admin/canary", headers=ADMIN).json()["canaries"][0]
    assert status["rolled_back"] and status["rollback"]["reason"] == "error_rate"
    assert status["rollback"]["canary_requests"] == MIN_REQUESTS

    # rolled back: every request goes to the baseline, the candidate sees nothing
    c.injector.error = None
    with httpx.Client(headers={"Authorization": f"Bearer {c.key}"}) as client:
        served = {c.predict(client).headers["x-fleetgate-deployment"].split(";")[0] for _ in range(60)}
    assert served == {"stable"} and c.injector.attempts == MIN_REQUESTS

    # only the admin key restores it; then it takes its 30% again
    tenant = {"Authorization": f"Bearer {c.key}"}
    assert httpx.post(f"{c.url}/admin/canary/digits/candidate/restore", headers=tenant).status_code == 401
    assert httpx.post(f"{c.url}/admin/canary/digits/stable/restore", headers=ADMIN).status_code == 404
    r = httpx.post(f"{c.url}/admin/canary/digits/candidate/restore", headers=ADMIN)
    assert r.status_code == 200 and r.json() == {
        "model": "digits",
        "deployment": "candidate",
        "restored": True,
        "weight": 30.0,
    }
    assert c.metric("fleetgate_route_effective_weight", model="digits", deployment="candidate") == 30.0
    with httpx.Client(headers=tenant) as client:
        served_list = [c.predict(client).headers["x-fleetgate-deployment"].split(";")[0] for _ in range(100)]
    assert 0.15 < served_list.count("candidate") / 100 < 0.45


def test_non_retryable_canary_failures_are_bounded_by_the_minimum_sample(fresh: Canary):
    """500s are not retried (the request may have had effects upstream), so callers see them, but
    only until the canary is judged: at most ceil(failure rate x min_requests) of them."""
    c = fresh
    c.injector.error = BackendInternalError
    sent, failed, seconds = _until_rollback(c)
    assert seconds < WINDOW_S
    bound = math.ceil(FAILURE_RATE * MIN_REQUESTS)
    assert failed == [500] * len(failed) and len(failed) == c.injector.failures <= bound
    with httpx.Client(headers={"Authorization": f"Bearer {c.key}"}) as client:
        assert all(c.predict(client).status_code == 200 for _ in range(50)), "nothing fails after it"


def test_reload_keeps_a_rollback_while_the_route_stays_a_canary(fresh: Canary):
    c = fresh
    c.injector.error = BackendUnavailable
    _until_rollback(c)
    c.path.write_text(_config(c.model, weight=40))  # an unrelated weight change
    assert httpx.post(f"{c.url}/admin/reload", headers=ADMIN).status_code == 200
    assert c.core.router.effective_weights("digits") == {"stable": 60, "candidate": 0.0}
    c.path.write_text(_config(c.model, canary="canary: false", weight=40))  # promoted: state dropped
    assert httpx.post(f"{c.url}/admin/reload", headers=ADMIN).status_code == 200
    assert c.core.router.effective_weights("digits") == {"stable": 60, "candidate": 40}
    assert httpx.get(f"{c.url}/admin/canary", headers=ADMIN).json() == {"canaries": []}


def _images_onnx(weights_path: Path, out: Path) -> Path:
    """The digits MLP with a changed input signature: 8 x 8 images instead of 64 features."""
    import numpy as np
    import onnx

    h, tp = onnx.helper, onnx.TensorProto
    weights = dict(np.load(weights_path))
    nodes = [
        h.make_node("Flatten", ["image"], ["input"], axis=1),
        h.make_node("MatMul", ["input", "W1"], ["z1"]),
        h.make_node("Add", ["z1", "b1"], ["a1"]),
        h.make_node("Relu", ["a1"], ["h1"]),
        h.make_node("MatMul", ["h1", "W2"], ["z2"]),
        h.make_node("Add", ["z2", "b2"], ["logits"]),
        h.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
    ]
    graph = h.make_graph(
        nodes,
        "digits_images",
        [h.make_tensor_value_info("image", tp.FLOAT, ["batch", 8, 8])],
        [h.make_tensor_value_info("probabilities", tp.FLOAT, ["batch", 10])],
        initializer=[onnx.numpy_helper.from_array(v, name=k) for k, v in weights.items()],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    out.write_bytes(model.SerializeToString())
    return out


def test_a_canary_that_refuses_every_request_is_rolled_back(digits, tmp_path):  # type: ignore[no-untyped-def]
    """A candidate whose input signature changed answers 400 to every caller and never faults;
    the baseline (same callers) answers them all, so its caller-error rate rolls it back."""
    images = _images_onnx(digits.weights_path, tmp_path / "digits_images.onnx")
    path = tmp_path / "gw.yaml"
    path.write_text(
        _config(digits.onnx_path).replace(
            f"candidate: {{backend: onnxruntime, model: {digits.onnx_path}}}",
            f"candidate: {{backend: onnxruntime, model: {images}}}",
        )
    )
    app = create_app(load_config(path), config_path=path)
    with serve_app(app) as url:
        c = Canary(url, create_key(url, "t"), path, digits.onnx_path, app.state.core, Injector(None))
        statuses: list[int] = []
        with httpx.Client(headers={"Authorization": f"Bearer {c.key}"}) as client:
            for _ in range(400):
                statuses.append(c.predict(client).status_code)
                if c.core.router.canaries.rolled_back("digits", "candidate"):
                    break
            else:
                raise AssertionError("the candidate answering 400 to everyone was never rolled back")
            # the baseline answered all its callers; the candidate refused every one (an error
            # answer names no deployment) and was judged at its MIN_REQUESTS-th outcome
            assert set(statuses) == {200, 400} and statuses.count(400) == MIN_REQUESTS
            assert all(c.predict(client).status_code == 200 for _ in range(30)), "nothing fails after it"
        reason = "caller_error_rate"
        assert c.metric("fleetgate_canary_rollbacks_total", deployment="candidate", reason=reason) == 1
        status = httpx.get(f"{url}/admin/canary", headers=ADMIN).json()["canaries"][0]
        assert status["rollback"]["reason"] == reason and status["window_caller_errors"] == MIN_REQUESTS
        assert status["rollback"]["canary_caller_error_rate"] == 1.0
        assert status["rollback"]["baseline_caller_error_rate"] == 0.0


def test_one_callers_wrong_shapes_never_roll_a_canary_back(fresh: Canary):
    """Requests every route refuses (63 features for a 64-feature model) are the caller's own
    mistake: they get their 400 but are not counted against the canary, however many there are."""
    wrong = {"instances": [[0.0] * 63]}
    with httpx.Client(headers={"Authorization": f"Bearer {fresh.key}"}) as client:
        for _ in range(6 * MIN_REQUESTS):
            r = client.post(f"{fresh.url}/v1/models/digits:predict", json=wrong)
            assert r.status_code == 400
        assert fresh.injector.attempts > MIN_REQUESTS  # the candidate refused plenty of them
        assert not fresh.core.router.canaries.rolled_back("digits", "candidate")
        assert all(fresh.predict(client).status_code == 200 for _ in range(20))
    status = httpx.get(f"{fresh.url}/admin/canary", headers=ADMIN).json()["canaries"][0]
    assert status["rollback"] is None and status["window_caller_errors"] == 0
