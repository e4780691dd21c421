"""TF Serving REST routes through the running gateway, and the /v1/models/{m} path rule."""

from __future__ import annotations

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from openai import NotFoundError, OpenAI

from backends.demo_models.digits import digits_split


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    return digits_split()[1][:5]


@pytest.fixture(scope="module")
def expected(digits, rows):  # type: ignore[no-untyped-def]
    session = ort.InferenceSession(str(digits.onnx_path), providers=["CPUExecutionProvider"])
    return session.run(["probabilities", "label"], {"input": rows})


def test_row_form_predictions(gateway, rows, expected):
    r = httpx.post(
        f"{gateway.url}/v1/models/digits:predict",
        json={"instances": rows.tolist()},
        headers=gateway.headers(),
    )
    assert r.status_code == 200, r.text
    preds = r.json()["predictions"]
    assert [p["label"] for p in preds] == expected[1].tolist()
    np.testing.assert_allclose([p["probabilities"] for p in preds], expected[0], atol=1e-6)


def test_columnar_form_outputs(gateway, rows, expected):
    r = httpx.post(
        f"{gateway.url}/v1/models/digits:predict",
        json={"inputs": {"input": rows.tolist()}},
        headers=gateway.headers(),
    )
    assert r.status_code == 200, r.text
    assert r.json()["outputs"]["label"] == expected[1].tolist()


@pytest.mark.parametrize("path", ["versions/2:predict", "labels/plain:predict", "labels/stable:predict"])
def test_versions_and_labels(gateway, rows, expected, path):
    r = httpx.post(
        f"{gateway.url}/v1/models/digits/{path}", json={"instances": rows.tolist()}, headers=gateway.headers()
    )
    assert r.status_code == 200, r.text
    assert [p["label"] for p in r.json()["predictions"]] == expected[1].tolist()
    served = r.headers["x-fleetgate-deployment"]
    assert served.startswith("digits-ort-plain;" if "plain" in path or "2" in path else "digits-ort;")


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("digits:predict", {"instances": [["a"] * 64]}, 400, "DT_FLOAT"),
        ("digits:predict", {"instances": [[1.0] * 3]}, 400, "shape [1, 3]"),
        ("digits:predict", {"instances": [[1.0] * 64, [1.0]]}, 400, "ragged"),
        ("digits:predict", {"instances": [], "inputs": []}, 400, "exactly one of"),
        ("digits:predict", {"inputs": {"nope": [[1.0] * 64]}}, 400, "unknown input 'nope'"),
        ("digits:classify", {"instances": [[1.0] * 64]}, 400, "not supported"),
        ("nope:predict", {"instances": [[1.0] * 64]}, 404, "does not exist"),
        ("digits/versions/9:predict", {"instances": [[1.0] * 64]}, 404, "no version '9'"),
        ("digits/labels/gold:predict", {"instances": [[1.0] * 64]}, 404, "no label 'gold'"),
    ],
)
def test_errors_in_tf_serving_envelope(gateway, path, body, status, needle):
    r = httpx.post(f"{gateway.url}/v1/models/{path}", json=body, headers=gateway.headers())
    assert r.status_code == status, r.text
    assert isinstance(r.json()["error"], str) and needle in r.json()["error"]


def test_malformed_json_is_400(gateway):
    r = httpx.post(
        f"{gateway.url}/v1/models/digits:predict",
        content=b"{",
        headers={**gateway.headers(), "content-type": "application/json"},
    )
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]


def test_status_and_metadata(gateway):
    status = httpx.get(f"{gateway.url}/v1/models/digits/versions/2", headers=gateway.headers()).json()
    assert status["model_version_status"] == [
        {"version": "2", "state": "AVAILABLE", "status": {"error_code": "OK", "error_message": ""}}
    ]
    meta = httpx.get(f"{gateway.url}/v1/models/digits/metadata", headers=gateway.headers()).json()
    sig = meta["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert sig["inputs"]["input"]["dtype"] == "DT_FLOAT"
    assert sig["outputs"]["label"]["dtype"] == "DT_INT64"


def test_shared_path_serves_both_openai_and_tf_serving_readers(gateway):
    """GET /v1/models/{m}: one body is an OpenAI Model object and a TF Serving status."""
    body = httpx.get(f"{gateway.url}/v1/models/digits", headers=gateway.headers()).json()
    assert body["model_version_status"][0]["state"] == "AVAILABLE"
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.key)
    model = client.models.retrieve("digits")
    assert model.id == "digits" and model.object == "model"
    with pytest.raises(NotFoundError):
        OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.other_key).models.retrieve("digits")
