"""Open Inference Protocol v2 through the running gateway, with tritonclient and plain HTTP."""

from __future__ import annotations

import json

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from backends.demo_models.digits import digits_split
from tests.conftest import ADMIN_HEADERS, Gateway


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    _, x_test, _, _ = digits_split()
    return x_test[:16]


def _direct(digits, x: np.ndarray) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    session = ort.InferenceSession(str(digits.onnx_path), providers=["CPUExecutionProvider"])
    return session.run(["probabilities", "label"], {"input": x})


def _client(gateway: Gateway) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(gateway.url.removeprefix("http://"))


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("model_version", ["", "2"], ids=["batched", "version-2"])
def test_tritonclient_outputs_equal_direct_onnxruntime(gateway, digits, rows, binary, model_version):
    client = _client(gateway)
    inp = triton.InferInput("input", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows, binary_data=binary)
    outs = [
        triton.InferRequestedOutput("probabilities", binary_data=binary),
        triton.InferRequestedOutput("label", binary_data=binary),
    ]
    result = client.infer(
        "digits", [inp], outputs=outs, model_version=model_version, headers=gateway.headers()
    )
    probs, labels = _direct(digits, rows)
    np.testing.assert_allclose(result.as_numpy("probabilities"), probs, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("label"), labels)


def test_tritonclient_default_binary_outputs_without_requested_outputs(gateway, digits, rows):
    client = _client(gateway)
    inp = triton.InferInput("input", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows)
    result = client.infer("digits", [inp], headers=gateway.headers())
    np.testing.assert_array_equal(result.as_numpy("label"), _direct(digits, rows)[1])


def test_metadata_ready_and_server_endpoints(gateway):
    client = _client(gateway)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits", headers=gateway.headers())
    meta = client.get_model_metadata("digits", headers=gateway.headers())
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert {o["name"] for o in meta["outputs"]} == {"probabilities", "label"}
    assert httpx.get(f"{gateway.url}/v2").json()["extensions"]


def test_nested_json_data_is_accepted(gateway, digits, rows):
    body = {"inputs": [{"name": "input", "shape": [2, 64], "datatype": "FP32", "data": rows[:2].tolist()}]}
    r = httpx.post(f"{gateway.url}/v2/models/digits/infer", json=body, headers=gateway.headers())
    assert r.status_code == 200, r.text
    labels = next(o for o in r.json()["outputs"] if o["name"] == "label")
    assert labels["data"] == _direct(digits, rows[:2])[1].tolist()
    assert r.headers["x-fleetgate-deployment"].startswith("digits-ort;")


def _post(gateway: Gateway, payload: object, **kw):  # type: ignore[no-untyped-def]
    content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    headers = {**gateway.headers(), "content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(
        f"{gateway.url}/v2/models/{kw.pop('model', 'digits')}/infer", content=content, headers=headers
    )


ROW = [0.0] * 64


@pytest.mark.parametrize(
    ("payload", "status", "needle"),
    [
        (b"{not json", 400, "malformed JSON"),
        (
            {"inputs": [{"name": "input", "shape": [1, 63], "datatype": "FP32", "data": ROW[:63]}]},
            400,
            "shape [1, 63]",
        ),
        (
            {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP64", "data": ROW}]},
            400,
            "datatype FP64",
        ),
        (
            {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": ROW[:10]}]},
            400,
            "10 elements",
        ),
        (
            {"inputs": [{"name": "wrong", "shape": [1, 64], "datatype": "FP32", "data": ROW}]},
            400,
            "unknown input 'wrong'",
        ),
        (
            {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": ["a"] * 64}]},
            400,
            "does not match datatype",
        ),
        (
            {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "NOPE", "data": ROW}]},
            400,
            "unsupported datatype",
        ),
        ({"inputs": []}, 400, "missing input"),
        ({"outputs": []}, 400, "inputs"),
    ],
)
def test_bad_input_is_400_naming_the_problem(gateway, payload, status, needle):
    r = _post(gateway, payload)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]


def test_binary_size_mismatch_is_400(gateway):
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [1, 64],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 100},
                }
            ]
        }
    ).encode()
    body = header + b"\0" * 100
    r = _post(
        gateway,
        body,
        headers={
            "Inference-Header-Content-Length": str(len(header)),
            "content-type": "application/octet-stream",
        },
    )
    assert r.status_code == 400
    assert "100 bytes given" in r.json()["error"]


def test_unknown_model_and_hidden_model_look_the_same(gateway):
    unknown = _post(gateway, {"inputs": []}, model="nope")
    hidden = _post(gateway, {"inputs": []}, model="digits", headers=gateway.headers(gateway.other_key))
    assert unknown.status_code == hidden.status_code == 404
    assert unknown.json()["error"] == "model 'nope' does not exist"
    assert hidden.json()["error"] == "model 'digits' does not exist"


def test_wrong_content_type_is_415(gateway):
    r = _post(gateway, {"inputs": []}, headers={"content-type": "text/plain"})
    assert r.status_code == 415
    assert "content type 'text/plain'" in r.json()["error"]


def test_oversized_body_is_413_before_reading(gateway):
    big = b"x" * (gateway.config.server.max_body_bytes + 1)
    r = _post(gateway, big)
    assert r.status_code == 413
    assert "exceeds" in r.json()["error"]


def test_oversized_chunked_body_is_413(gateway):
    def chunks():  # type: ignore[no-untyped-def]
        for _ in range(100):
            yield b"y" * 1024

    r = httpx.post(
        f"{gateway.url}/v2/models/digits/infer",
        content=chunks(),
        headers={**gateway.headers(), "content-type": "application/json"},
    )
    assert r.status_code == 413


def test_missing_and_bad_keys_are_401_in_v2_envelope(gateway):
    r = httpx.post(f"{gateway.url}/v2/models/digits/infer", json={"inputs": []})
    assert r.status_code == 401 and isinstance(r.json()["error"], str)
    r = httpx.post(
        f"{gateway.url}/v2/models/digits/infer",
        json={"inputs": []},
        headers={"x-api-key": "fg-000000000000-nope"},
    )
    assert r.status_code == 401
    assert "fg-000000000000-nope" not in r.text


def test_tritonclient_surfaces_gateway_errors(gateway):
    client = _client(gateway)
    inp = triton.InferInput("input", [1, 3], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 3), np.float32))
    with pytest.raises(InferenceServerException, match="shape"):
        client.infer("digits", [inp], headers=gateway.headers())


def test_metrics_count_requests_without_secrets(gateway, rows):
    client = _client(gateway)
    inp = triton.InferInput("input", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows)
    client.infer("digits", [inp], headers=gateway.headers())
    text = httpx.get(f"{gateway.url}/metrics", headers=ADMIN_HEADERS).text
    assert (
        'fleetgate_requests_total{deployment="digits-ort",model="digits",protocol="v2",status="200",tenant="acme"}'
        in text
    )
    assert "fleetgate_batch_size_rows_bucket" in text
    assert "fleetgate_queue_depth" in text
    assert (
        gateway.key not in text and gateway.key.split("-", 2)[2] not in text
    )  # the secret may itself hold "-"


def test_made_up_model_names_do_not_become_metric_labels(gateway, rows):
    """Names a client invents (with or without a key) are labelled "unknown": /metrics stays bounded."""
    for i in range(5):
        httpx.post(f"{gateway.url}/v2/models/junk-{i}/infer", json={"inputs": []})
        httpx.post(
            f"{gateway.url}/v2/models/junk-auth-{i}/infer", json={"inputs": []}, headers=gateway.headers()
        )
    text = httpx.get(f"{gateway.url}/metrics", headers=ADMIN_HEADERS).text
    assert "junk-" not in text
    assert 'model="unknown",protocol="v2",status="401"' in text
    assert 'model="unknown",protocol="v2",status="404"' in text


def test_remote_v2_backend_chains_to_another_fleetgate(gateway, digits, rows, monkeypatch):
    """A second gateway whose deployment is the first gateway, over the Open Inference Protocol."""
    from pathlib import Path

    from gateway.config import parse_config
    from gateway.http.app import create_app
    from tests.conftest import create_key
    from tests.servers import serve_app

    monkeypatch.setenv("CHAIN_UPSTREAM_KEY", gateway.key)
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{edge: {{}}}}
deployments:
  upstream: {{backend: remote, url: "{gateway.url}", protocol: kserve_v2, model_name: digits, api_key_env: CHAIN_UPSTREAM_KEY}}
models:
  digits-via-edge: {{routes: [{{deployment: upstream}}]}}
""",
        base_dir=Path("."),
    )
    with serve_app(create_app(config)) as url:
        key = create_key(url, "edge")
        client = triton.InferenceServerClient(url.removeprefix("http://"))
        inp = triton.InferInput("input", list(rows.shape), "FP32")
        inp.set_data_from_numpy(rows)
        result = client.infer("digits-via-edge", [inp], headers={"Authorization": f"Bearer {key}"})
        np.testing.assert_array_equal(result.as_numpy("label"), _direct(digits, rows)[1])
        bad = triton.InferInput("input", [1, 5], "FP32")
        bad.set_data_from_numpy(np.zeros((1, 5), np.float32))
        with pytest.raises(InferenceServerException, match="shape"):
            client.infer("digits-via-edge", [bad], headers={"Authorization": f"Bearer {key}"})


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_binary_inputs_are_400_as_on_grpc(gateway, rows, bad):
    """The binary tensor extension can carry NaN and infinities (JSON cannot): refused with the
    same message as the gRPC front, never answered with NaN outputs."""
    x = rows[:2].copy()
    x[1, 3] = bad
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    with pytest.raises(InferenceServerException, match="finite") as raised:
        _client(gateway).infer("digits", [inp], headers=gateway.headers())
    assert raised.value.status() in ("400", 400)
