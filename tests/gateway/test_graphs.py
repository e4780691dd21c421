"""Model graphs through a real gateway and real clients: a three-step ensemble (pre-processing, two
runtimes in parallel, an average) equal to the steps computed by hand over v2 HTTP (binary and
JSON), tritonclient.grpc and TF Serving REST; cascades whose branch counts (metrics) match the
data; tenancy (the graph is what a tenant needs access to, charged once, usage per step); a failing
step named in each protocol's error, or replaced by its model's fallback."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
import yaml
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from backends.errors import BackendUnavailable, InvalidInput
from gateway.config import parse_config
from gateway.core.service import GatewayCore
from gateway.http.app import create_app
from tests.conftest import ADMIN_HEADERS, create_key
from tests.graph_models import (
    GraphModels,
    ensemble_by_hand,
    ensemble_steps,
    mlp_by_hand,
    step_sections,
    write_graph_models,
)
from tests.servers import free_port, serve_app

pytestmark = pytest.mark.slow

ROWS = 24


@dataclass
class GraphGateway:
    url: str
    target: str
    core: GatewayCore
    models: GraphModels
    #: the cascade's threshold: rows whose small-model top probability is below it escalate
    threshold: float
    acme: str
    inner: str
    limited: str
    budgeted: str


def _threshold(models: GraphModels, x: np.ndarray) -> float:
    """Halfway between two neighbouring top probabilities near the median: no row sits on it."""
    top = np.sort(mlp_by_hand(models.weights["mlp_a"], x).max(axis=1))
    middle = len(top) // 2
    return float((top[middle - 1] + top[middle]) / 2)


def _pixels(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0, 16, (n, 64)).astype(np.float32)


def _config(models: GraphModels, grpc_port: int, threshold: float) -> str:
    def cascade(per_row: bool) -> dict:
        return {
            "steps": {
                "small": {"model": "mlp-a", "inputs": {"x": "request.x"}},
                "large": {
                    "model": "mlp-b",
                    "inputs": {"x": "request.x"},
                    "when": {
                        "tensor": "small.probs",
                        "reduce": "max",
                        "below": threshold,
                        "per_row": per_row,
                    },
                },
            },
            "outputs": {"probabilities": ["large.probs", "small.probs"]},
        }

    deployments, served = step_sections(models)
    # priced steps: mlp-a by its model, mlp-b by each deployment (OpenVINO dearer than its fallback)
    served["mlp-a"]["pricing"] = {"usd_per_row": 0.001}
    deployments["b-ov"]["pricing"] = {"usd_per_row": 0.004, "usd_per_request": 0.01}
    deployments["b-ort"]["pricing"] = {"usd_per_row": 0.002}
    return yaml.safe_dump(
        {
            "server": {"grpc_port": grpc_port, "max_body_bytes": 1 << 20},
            "state": {"url": "memory://"},
            "breakers": {"failure_threshold": 1000},
            "tenants": {
                "acme": {"models": ["ensemble", "cascade*"]},
                "inner": {"models": ["mlp-*", "scale", "average"]},
                "limited": {"models": ["ensemble"], "limits": {"requests_per_minute": 3}},
                "budgeted": {"models": ["cascade"], "budget": {"usd_per_day": 0.2}},
            },
            "deployments": deployments,
            "models": served,
            "graphs": {
                "ensemble": {
                    "steps": ensemble_steps(),
                    "outputs": {"probabilities": "mean.mean"},
                },
                "cascade": cascade(per_row=True),
                "cascade-whole": cascade(per_row=False),
            },
        },
        sort_keys=False,
    )


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GraphGateway]:
    models = write_graph_models(tmp_path_factory.mktemp("graph-models"))
    threshold = _threshold(models, _pixels(ROWS, 7) / 16)
    port = free_port()
    app = create_app(parse_config(_config(models, port, threshold), base_dir=Path(".")))
    with serve_app(app) as url:
        yield GraphGateway(
            url=url,
            target=f"127.0.0.1:{port}",
            core=app.state.core,
            models=models,
            threshold=threshold,
            acme=create_key(url, "acme"),
            inner=create_key(url, "inner"),
            limited=create_key(url, "limited"),
            budgeted=create_key(url, "budgeted"),
        )


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _v2_json(gw: GraphGateway, model: str, key: str, name: str, rows: np.ndarray) -> httpx.Response:
    body = {
        "inputs": [
            {"name": name, "datatype": "FP32", "shape": list(rows.shape), "data": rows.ravel().tolist()}
        ]
    }
    return httpx.post(f"{gw.url}/v2/models/{model}/infer", json=body, headers=_auth(key), timeout=60)


def _probabilities(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    (out,) = response.json()["outputs"]
    assert out["name"] == "probabilities"
    return np.array(out["data"], dtype=np.float64).reshape(out["shape"])


def _counter(gw: GraphGateway, family: str, **labels: str) -> float:
    text = httpx.get(f"{gw.url}/metrics", headers=ADMIN_HEADERS).text
    for metric in text_string_to_metric_families(text):
        for sample in metric.samples:
            if sample.name == family and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


# --- the ensemble, over every protocol -------------------------------------------------------------


def test_ensemble_over_v2_http_binary_and_json(gw: GraphGateway) -> None:
    rows = _pixels(ROWS, 1)
    expected = ensemble_by_hand(gw.models, rows)
    client = triton_http.InferenceServerClient(gw.url.removeprefix("http://"))
    meta = client.get_model_metadata("ensemble", headers=_auth(gw.acme))
    assert meta["platform"] == "ensemble"
    assert meta["inputs"] == [{"name": "pixels", "datatype": "FP32", "shape": [-1, 64]}]
    assert meta["outputs"] == [{"name": "probabilities", "datatype": "FP32", "shape": [-1, 10]}]
    assert client.is_model_ready("ensemble", headers=_auth(gw.acme))
    pixels = triton_http.InferInput("pixels", list(rows.shape), "FP32")
    pixels.set_data_from_numpy(rows, binary_data=True)
    wanted = [triton_http.InferRequestedOutput("probabilities", binary_data=True)]
    result = client.infer("ensemble", [pixels], outputs=wanted, headers=_auth(gw.acme))
    np.testing.assert_allclose(result.as_numpy("probabilities"), expected, atol=1e-5)

    response = _v2_json(gw, "ensemble", gw.acme, "pixels", rows)
    np.testing.assert_allclose(_probabilities(response), expected, atol=1e-5)
    graph, steps = response.headers["x-fleetgate-deployment"].split("; steps=")
    assert graph == "graph=ensemble"
    assert dict(s.split(":") for s in steps.split(",")) == {
        "pre": "scale-ort",
        "a": "a-ort",
        "b": "b-ov",
        "mean": "avg-ort",
    }


def test_ensemble_over_tritonclient_grpc(gw: GraphGateway) -> None:
    rows = _pixels(5, 2)
    client = triton_grpc.InferenceServerClient(gw.target)
    headers = {"authorization": f"Bearer {gw.acme}"}
    meta = client.get_model_metadata("ensemble", headers=headers, as_json=True)
    assert meta["inputs"][0]["name"] == "pixels" and meta["outputs"][0]["name"] == "probabilities"
    config = client.get_model_config("ensemble", headers=headers, as_json=True)["config"]
    assert config["platform"] == "ensemble" and config["input"][0]["data_type"] == "TYPE_FP32"
    assert client.is_model_ready("ensemble", headers=headers)
    index = client.get_model_repository_index(headers=headers, as_json=True)["models"]
    assert {m["name"] for m in index} == {"ensemble", "cascade", "cascade-whole"}
    pixels = triton_grpc.InferInput("pixels", list(rows.shape), "FP32")
    pixels.set_data_from_numpy(rows)
    result = client.infer("ensemble", [pixels], headers=headers)
    np.testing.assert_allclose(result.as_numpy("probabilities"), ensemble_by_hand(gw.models, rows), atol=1e-5)


def test_ensemble_over_tfserving_rest(gw: GraphGateway) -> None:
    rows = _pixels(4, 3)
    expected = ensemble_by_hand(gw.models, rows)
    answer = httpx.post(
        f"{gw.url}/v1/models/ensemble:predict", json={"instances": rows.tolist()}, headers=_auth(gw.acme)
    )
    assert answer.status_code == 200, answer.text
    np.testing.assert_allclose(np.array(answer.json()["predictions"]), expected, atol=1e-5)
    answer = httpx.post(
        f"{gw.url}/v1/models/ensemble:predict", json={"inputs": rows.tolist()}, headers=_auth(gw.acme)
    )
    np.testing.assert_allclose(np.array(answer.json()["outputs"]), expected, atol=1e-5)
    meta = httpx.get(f"{gw.url}/v1/models/ensemble/metadata", headers=_auth(gw.acme)).json()
    signature = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert set(signature["inputs"]) == {"pixels"} and set(signature["outputs"]) == {"probabilities"}
    status = httpx.get(f"{gw.url}/v1/models/ensemble", headers=_auth(gw.acme)).json()
    assert status["model_version_status"][0]["state"] == "AVAILABLE"


def test_cascade_over_tfserving_grpc(gw: GraphGateway) -> None:
    """TF Serving's own stubs: Predict, GetModelMetadata and GetModelStatus of a graph."""
    from tensorflow.core.framework import tensor_pb2, types_pb2
    from tensorflow_serving.apis import (
        get_model_metadata_pb2,
        get_model_status_pb2,
        model_service_pb2_grpc,
        predict_pb2,
        prediction_service_pb2_grpc,
    )

    x = _pixels(ROWS, 7) / 16
    x = x.astype(np.float32)
    small = mlp_by_hand(gw.models.weights["mlp_a"], x)
    escalate = small.max(axis=1) < gw.threshold
    expected = np.where(escalate[:, None], mlp_by_hand(gw.models.weights["mlp_b"], x), small)
    metadata = (("authorization", f"Bearer {gw.acme}"),)
    with grpc.insecure_channel(gw.target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        request = predict_pb2.PredictRequest()
        request.model_spec.name = "cascade"
        proto = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_content=x.tobytes())
        proto.tensor_shape.dim.add(size=x.shape[0])
        proto.tensor_shape.dim.add(size=x.shape[1])
        request.inputs["x"].CopyFrom(proto)
        answer = stub.Predict(request, metadata=metadata)
        probs = np.frombuffer(answer.outputs["probabilities"].tensor_content, np.float32).reshape(ROWS, 10)
        np.testing.assert_allclose(probs, expected, atol=1e-5)

        meta_request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        meta_request.model_spec.name = "cascade"
        signatures = get_model_metadata_pb2.SignatureDefMap()
        stub.GetModelMetadata(meta_request, metadata=metadata).metadata["signature_def"].Unpack(signatures)
        signature = signatures.signature_def["serving_default"]
        assert list(signature.inputs) == ["x"] and list(signature.outputs) == ["probabilities"]
        status_request = get_model_status_pb2.GetModelStatusRequest()
        status_request.model_spec.name = "cascade"
        status = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
            status_request, metadata=metadata
        )
        assert [(s.version, s.state) for s in status.model_version_status] == [(1, 30)]  # AVAILABLE
        request.model_spec.version.value = 2  # a graph has no versions
        with pytest.raises(grpc.RpcError) as err:
            stub.Predict(request, metadata=metadata)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "no versions" in err.value.details()


@contextmanager
def _replaced_infer(gw: GraphGateway, deployment: str, infer: Any) -> Iterator[Any]:
    """Failure injection: the deployment's backend answers with `infer(request, original)`."""
    backend = gw.core.deployments[deployment].backend
    original = backend.infer

    async def patched(request: Any) -> Any:
        return await infer(request, original)

    backend.infer = patched  # type: ignore[method-assign]
    try:
        yield
    finally:
        del backend.infer  # type: ignore[method-assign]


def test_independent_steps_run_concurrently(gw: GraphGateway) -> None:
    """`a` and `b` each wait until the other has started: run one after the other, they never would."""
    started = {"a-ort": asyncio.Event(), "b-ov": asyncio.Event()}

    def meeting(me: str, other: str) -> Any:
        async def infer(request: Any, original: Any) -> Any:
            started[me].set()
            await asyncio.wait_for(started[other].wait(), 30)
            return await original(request)

        return infer

    rows = _pixels(3, 4)
    with (
        _replaced_infer(gw, "a-ort", meeting("a-ort", "b-ov")),
        _replaced_infer(gw, "b-ov", meeting("b-ov", "a-ort")),
    ):
        response = _v2_json(gw, "ensemble", gw.acme, "pixels", rows)
    np.testing.assert_allclose(_probabilities(response), ensemble_by_hand(gw.models, rows), atol=1e-5)


# --- cascades --------------------------------------------------------------------------------------


def test_per_row_cascade_answers_and_counts_match_the_data(gw: GraphGateway) -> None:
    x = _pixels(ROWS, 7) / 16
    small = mlp_by_hand(gw.models.weights["mlp_a"], x)
    escalate = small.max(axis=1) < gw.threshold
    assert 0 < escalate.sum() < ROWS
    expected = np.where(escalate[:, None], mlp_by_hand(gw.models.weights["mlp_b"], x), small)
    labels = {"graph": "cascade", "step": "large"}
    before = {
        o: _counter(gw, "fleetgate_graph_step_rows_total", outcome=o, **labels) for o in ("ran", "skipped")
    }
    steps_before = _counter(gw, "fleetgate_graph_steps_total", outcome="ran", **labels)

    np.testing.assert_allclose(_probabilities(_v2_json(gw, "cascade", gw.acme, "x", x)), expected, atol=1e-5)

    after = {
        o: _counter(gw, "fleetgate_graph_step_rows_total", outcome=o, **labels) for o in ("ran", "skipped")
    }
    assert after["ran"] - before["ran"] == escalate.sum()
    assert after["skipped"] - before["skipped"] == ROWS - escalate.sum()
    assert _counter(gw, "fleetgate_graph_steps_total", outcome="ran", **labels) - steps_before == 1


def test_whole_request_cascade_counts_match_the_data(gw: GraphGateway) -> None:
    x = _pixels(ROWS, 7) / 16
    small = mlp_by_hand(gw.models.weights["mlp_a"], x)
    large = mlp_by_hand(gw.models.weights["mlp_b"], x)
    escalate = small.max(axis=1) < gw.threshold
    labels = {"graph": "cascade-whole", "step": "large"}
    before = {o: _counter(gw, "fleetgate_graph_steps_total", outcome=o, **labels) for o in ("ran", "skipped")}
    for i in range(ROWS):  # one row per request: each request escalates or not
        answer = _probabilities(_v2_json(gw, "cascade-whole", gw.acme, "x", x[i : i + 1]))
        np.testing.assert_allclose(answer[0], large[i] if escalate[i] else small[i], atol=1e-5)
    after = {o: _counter(gw, "fleetgate_graph_steps_total", outcome=o, **labels) for o in ("ran", "skipped")}
    assert after["ran"] - before["ran"] == escalate.sum()
    assert after["skipped"] - before["skipped"] == ROWS - escalate.sum()


# --- tenancy -----------------------------------------------------------------------------------------


def test_access_to_the_graph_suffices_and_only_it(gw: GraphGateway) -> None:
    rows = _pixels(2, 5)
    # acme may call the graph but none of its inner models
    assert _v2_json(gw, "mlp-a", gw.acme, "x", rows / 16).status_code == 404
    # inner may call every inner model but not the graph: 404, as if it did not exist
    assert _v2_json(gw, "mlp-a", gw.inner, "x", rows / 16).status_code == 200
    refused = _v2_json(gw, "ensemble", gw.inner, "pixels", rows)
    assert refused.status_code == 404 and refused.json() == {"error": "model 'ensemble' does not exist"}
    assert httpx.get(f"{gw.url}/v2/models/ensemble", headers=_auth(gw.inner)).status_code == 404
    tfs = httpx.post(
        f"{gw.url}/v1/models/ensemble:predict", json={"instances": rows.tolist()}, headers=_auth(gw.inner)
    )
    assert tfs.status_code == 404
    client = triton_grpc.InferenceServerClient(gw.target)
    pixels = triton_grpc.InferInput("pixels", list(rows.shape), "FP32")
    pixels.set_data_from_numpy(rows)
    with pytest.raises(InferenceServerException) as err:
        client.infer("ensemble", [pixels], headers={"authorization": f"Bearer {gw.inner}"})
    assert err.value.status() == "StatusCode.NOT_FOUND"
    listed = httpx.get(f"{gw.url}/v1/models", headers=_auth(gw.inner)).json()["data"]
    assert "ensemble" not in {m["id"] for m in listed}


def test_limits_charged_once_per_graph_request_and_usage_per_step(gw: GraphGateway) -> None:
    rows = _pixels(6, 6)
    # 3 requests a minute: the graph's four steps are not each a request
    for _ in range(3):
        _probabilities(_v2_json(gw, "ensemble", gw.limited, "pixels", rows))
    refused = _v2_json(gw, "ensemble", gw.limited, "pixels", rows)
    assert refused.status_code == 429 and "Retry-After" in refused.headers
    usage = httpx.get(f"{gw.url}/admin/usage", params={"tenant": "limited"}, headers=ADMIN_HEADERS).json()[
        "usage"
    ]
    days = {u["model"]: (u["requests"], u["tokens"]) for u in usage if len(u["period"]) == 10}
    assert days == {
        "ensemble": (3, 18),
        "ensemble/pre": (3, 18),
        "ensemble/a": (3, 18),
        "ensemble/b": (3, 18),
        "ensemble/mean": (3, 18),
    }


def test_a_graph_request_costs_its_steps_and_holds_its_worst_case_on_the_budget(gw: GraphGateway) -> None:
    """Each step that ran is priced as a request to its model on the deployment that served it; the
    worst case (every row through every step, at the dearest deployment) is reserved at admission."""
    x = _pixels(ROWS, 7) / 16
    escalated = int((mlp_by_hand(gw.models.weights["mlp_a"], x).max(axis=1) < gw.threshold).sum())
    _probabilities(_v2_json(gw, "cascade", gw.budgeted, "x", x))
    usage = httpx.get(f"{gw.url}/admin/usage", params={"tenant": "budgeted"}, headers=ADMIN_HEADERS).json()
    (day,) = [u for u in usage["usage"] if u["model"] == "cascade" and len(u["period"]) == 10]
    spent = ROWS * 0.001 + escalated * 0.004 + 0.01  # small on every row; large on b-ov for the escalated
    assert day["cost_usd"] == pytest.approx(spent, abs=1e-9)
    # the next one's worst case, 24 x 0.001 + 24 x 0.004 + 0.01, is more than the 0.2 USD budget has left
    refused = _v2_json(gw, "cascade", gw.budgeted, "x", x)
    assert refused.status_code == 429, refused.text
    assert "budget usd_per_day of tenant 'budgeted'" in refused.text


def test_bad_input_is_refused_against_the_graphs_inputs(gw: GraphGateway) -> None:
    refused = _v2_json(gw, "ensemble", gw.acme, "pixels", np.zeros((2, 63), np.float32))
    assert refused.status_code == 400 and "pixels" in refused.json()["error"]
    refused = _v2_json(gw, "ensemble", gw.acme, "raw", np.zeros((2, 64), np.float32))
    assert refused.status_code == 400 and "unknown input 'raw'" in refused.json()["error"]


# --- a failing step ----------------------------------------------------------------------------------


async def _unavailable(request: Any, original: Any) -> Any:
    raise BackendUnavailable("injected outage")


def test_failing_step_takes_its_models_fallback(gw: GraphGateway) -> None:
    rows = _pixels(3, 8)
    with _replaced_infer(gw, "b-ov", _unavailable):
        response = _v2_json(gw, "ensemble", gw.acme, "pixels", rows)
    np.testing.assert_allclose(_probabilities(response), ensemble_by_hand(gw.models, rows), atol=1e-5)
    assert "b:b-ort" in response.headers["x-fleetgate-deployment"]


def test_failing_step_fails_the_request_naming_the_step(gw: GraphGateway) -> None:
    rows = _pixels(3, 9)
    with _replaced_infer(gw, "a-ort", _unavailable):
        response = _v2_json(gw, "ensemble", gw.acme, "pixels", rows)
        assert response.status_code == 503
        # acme may call the graph but not see mlp-a: the step is named, its model and message are not
        error = response.json()["error"]
        assert error.startswith("graph 'ensemble' step 'a' failed") and "mlp-a" not in error and "injected" not in error
        tfs = httpx.post(
            f"{gw.url}/v1/models/ensemble:predict", json={"instances": rows.tolist()}, headers=_auth(gw.acme)
        )
        assert tfs.status_code == 503 and "step 'a'" in tfs.json()["error"]
        client = triton_grpc.InferenceServerClient(gw.target)
        pixels = triton_grpc.InferInput("pixels", list(rows.shape), "FP32")
        pixels.set_data_from_numpy(rows)
        with pytest.raises(InferenceServerException) as err:
            client.infer("ensemble", [pixels], headers={"authorization": f"Bearer {gw.acme}"})
        assert err.value.status() == "StatusCode.UNAVAILABLE" and "step 'a'" in err.value.message()

    async def refuse(request: Any, original: Any) -> Any:
        raise InvalidInput("injected refusal")

    with _replaced_infer(gw, "avg-ort", refuse):
        response = _v2_json(gw, "ensemble", gw.acme, "pixels", rows)
    assert response.status_code == 400 and "step 'mean'" in response.json()["error"]
    assert "average" not in response.json()["error"]
    assert _counter(gw, "fleetgate_graph_steps_total", graph="ensemble", step="mean", outcome="failed") >= 1


def test_a_reload_changes_a_graph_in_place(gw: GraphGateway) -> None:
    """Every step escalates once the threshold is raised above any probability; then back."""
    from gateway.admin.reload import apply_config

    x = (_pixels(ROWS, 11) / 16).astype(np.float32)
    x = x[mlp_by_hand(gw.models.weights["mlp_a"], x).max(axis=1) >= gw.threshold][:3]  # none escalates now
    assert len(x) == 3
    large = mlp_by_hand(gw.models.weights["mlp_b"], x)
    running = gw.core.config
    raised = parse_config(_config(gw.models, int(running.server.grpc_port or 0), 2.0), base_dir=Path("."))
    labels = {"graph": "cascade-whole", "step": "large", "outcome": "ran"}
    small = _probabilities(_v2_json(gw, "cascade-whole", gw.acme, "x", x[:1]))  # the graph as it was
    np.testing.assert_allclose(small[0], mlp_by_hand(gw.models.weights["mlp_a"], x[:1])[0], atol=1e-5)
    before = _counter(gw, "fleetgate_graph_steps_total", **labels)
    apply_config(gw.core, raised)
    try:
        for i in range(3):
            np.testing.assert_allclose(
                _probabilities(_v2_json(gw, "cascade-whole", gw.acme, "x", x[i : i + 1]))[0],
                large[i],
                atol=1e-5,
            )
    finally:
        apply_config(gw.core, running)
    assert _counter(gw, "fleetgate_graph_steps_total", **labels) - before == 3


def test_a_graph_on_a_text_endpoint_is_a_clear_400(gw: GraphGateway) -> None:
    body = {"model": "ensemble", "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=_auth(gw.acme))
    assert answer.status_code == 400
    assert "is a graph of tensor models" in answer.json()["error"]["message"]
    listed = httpx.get(f"{gw.url}/v1/models", headers=_auth(gw.acme)).json()["data"]
    assert {m["id"] for m in listed} == {"ensemble", "cascade", "cascade-whole"}
