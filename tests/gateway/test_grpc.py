"""The gRPC front door with unchanged clients: tritonclient.grpc (sync and aio), TF Serving's
PredictionServiceStub and ModelServiceStub, the standard health check, reflection; tenancy, limits
shared with HTTP, and every kind of bad input answered with a clear status, never INTERNAL."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from backends.demo_models.digits import digits_split
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import create_key
from tests.servers import free_port, serve_app

pytestmark = pytest.mark.slow


@dataclass
class GrpcGateway:
    url: str
    target: str
    acme: str
    other: str
    limited: str


def grpc_yaml(onnx_path: Path, grpc_port: int) -> str:
    return f"""
server: {{grpc_port: {grpc_port}, max_body_bytes: 65536}}
state: {{url: "memory://"}}
tenants:
  acme: {{}}
  other: {{models: ["echo*"]}}
  limited: {{limits: {{requests_per_minute: 4}}}}
deployments:
  ort-a: {{backend: onnxruntime, model: {onnx_path}, batching: {{max_batch_size: 32, max_delay_ms: 2}}}}
  ort-b: {{backend: onnxruntime, model: {onnx_path}}}
models:
  digits:
    routes: [{{deployment: ort-a}}]
    versions: {{"1": ort-a, "2": ort-b}}
    labels: {{stable: "1", plain: "2"}}
"""


@pytest.fixture(scope="module")
def gw(digits) -> Iterator[GrpcGateway]:  # noqa: ANN001
    port = free_port()
    config = parse_config(grpc_yaml(digits.onnx_path, port), base_dir=Path("."))
    with serve_app(create_app(config)) as url:
        yield GrpcGateway(
            url=url,
            target=f"127.0.0.1:{port}",
            acme=create_key(url, "acme"),
            other=create_key(url, "other"),
            limited=create_key(url, "limited"),
        )


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    return digits_split()[1][:8]


def _direct(digits, x: np.ndarray) -> list[np.ndarray]:  # noqa: ANN001
    session = ort.InferenceSession(str(digits.onnx_path), providers=["CPUExecutionProvider"])
    return session.run(["probabilities", "label"], {"input": x})


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


# --- tritonclient.grpc ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["", "2"])
def test_tritonclient_grpc_infer_equals_the_runtime(gw, digits, rows, version) -> None:  # noqa: ANN001
    client = triton_grpc.InferenceServerClient(gw.target)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("digits", headers=_auth(gw.acme))
    meta = client.get_model_metadata("digits", headers=_auth(gw.acme), as_json=True)
    assert meta["inputs"][0]["name"] == "input" and {o["name"] for o in meta["outputs"]} == {
        "probabilities",
        "label",
    }
    config = client.get_model_config("digits", headers=_auth(gw.acme), as_json=True)["config"]
    assert config["input"][0]["name"] == "input" and config["input"][0]["data_type"] == "TYPE_FP32"

    inp = triton_grpc.InferInput("input", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows)  # raw_input_contents, as tritonclient sends by default
    outputs = [triton_grpc.InferRequestedOutput("probabilities"), triton_grpc.InferRequestedOutput("label")]
    result = client.infer("digits", [inp], model_version=version, outputs=outputs, headers=_auth(gw.acme))
    probs, labels = _direct(digits, rows)
    np.testing.assert_allclose(result.as_numpy("probabilities"), probs, atol=1e-6)
    np.testing.assert_array_equal(result.as_numpy("label"), labels)
    assert result.get_response().model_version == (version or "")


def test_typed_contents_are_served_too(gw, digits, rows) -> None:  # noqa: ANN001
    """A request with typed `contents` instead of raw bytes (other v2 clients send those)."""
    request = service_pb2.ModelInferRequest(model_name="digits", id="typed-1")
    tensor = request.inputs.add(name="input", datatype="FP32", shape=list(rows.shape))
    tensor.contents.fp32_contents.extend(rows.ravel().tolist())
    with grpc.insecure_channel(gw.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        answer = stub.ModelInfer(request, metadata=tuple(_auth(gw.acme).items()))
    assert answer.id == "typed-1"
    names = [o.name for o in answer.outputs]
    probs = np.frombuffer(answer.raw_output_contents[names.index("probabilities")], np.float32).reshape(8, 10)
    np.testing.assert_allclose(probs, _direct(digits, rows)[0], atol=1e-6)


async def test_tritonclient_grpc_aio(gw, digits, rows) -> None:  # noqa: ANN001
    client = triton_aio.InferenceServerClient(gw.target)
    try:
        inp = triton_aio.InferInput("input", list(rows.shape), "FP32")
        inp.set_data_from_numpy(rows)
        results = await asyncio.gather(
            *(client.infer("digits", [inp], headers=_auth(gw.acme)) for _ in range(6))
        )
        for result in results:
            np.testing.assert_allclose(result.as_numpy("probabilities"), _direct(digits, rows)[0], atol=1e-6)
    finally:
        await client.close()


# --- TF Serving stubs ----------------------------------------------------------------------------


def test_tfserving_predict_by_version_and_label(gw, digits, rows) -> None:  # noqa: ANN001
    from tensorflow.core.framework import tensor_pb2, types_pb2
    from tensorflow_serving.apis import (
        get_model_metadata_pb2,
        get_model_status_pb2,
        model_service_pb2_grpc,
        predict_pb2,
        prediction_service_pb2_grpc,
    )

    metadata = tuple(_auth(gw.acme).items())
    with grpc.insecure_channel(gw.target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for spec in ({"version": 2}, {"version_label": "stable"}, {}):
            request = predict_pb2.PredictRequest()
            request.model_spec.name = "digits"
            if "version" in spec:
                request.model_spec.version.value = spec["version"]
            if "version_label" in spec:
                request.model_spec.version_label = spec["version_label"]
            proto = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_content=rows.tobytes())
            proto.tensor_shape.dim.add(size=rows.shape[0])
            proto.tensor_shape.dim.add(size=rows.shape[1])
            request.inputs["input"].CopyFrom(proto)
            answer = stub.Predict(request, metadata=metadata)
            probs = np.frombuffer(answer.outputs["probabilities"].tensor_content, np.float32).reshape(8, 10)
            np.testing.assert_allclose(probs, _direct(digits, rows)[0], atol=1e-6)
            if "version" in spec:
                assert answer.model_spec.version.value == 2
        meta_request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        meta_request.model_spec.name = "digits"
        meta = stub.GetModelMetadata(meta_request, metadata=metadata)
        signatures = get_model_metadata_pb2.SignatureDefMap()
        meta.metadata["signature_def"].Unpack(signatures)
        assert list(signatures.signature_def["serving_default"].inputs) == ["input"]
        status_request = get_model_status_pb2.GetModelStatusRequest()
        status_request.model_spec.name = "digits"
        status = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
            status_request, metadata=metadata
        )
        assert {(s.version, s.state) for s in status.model_version_status} == {(1, 30), (2, 30)}  # AVAILABLE


# --- health and reflection ----------------------------------------------------------------------


def test_health_check_and_reflection(gw) -> None:  # noqa: ANN001
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(gw.target) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        services = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {
        "inference.GRPCInferenceService",
        "grpc.health.v1.Health",
        "tensorflow.serving.PredictionService",
    } <= services


# --- tenancy and limits ----------------------------------------------------------------------------


def _code(fn) -> grpc.StatusCode:  # noqa: ANN001
    with pytest.raises(InferenceServerException) as info:
        fn()
    return info.value.status()


def test_auth_and_visibility_rules(gw, rows) -> None:  # noqa: ANN001
    client = triton_grpc.InferenceServerClient(gw.target)
    inp = triton_grpc.InferInput("input", list(rows.shape), "FP32")
    inp.set_data_from_numpy(rows)
    assert _code(lambda: client.infer("digits", [inp])) == "StatusCode.UNAUTHENTICATED"
    assert (
        _code(lambda: client.infer("digits", [inp], headers=_auth("fg-nope"))) == "StatusCode.UNAUTHENTICATED"
    )
    # a model outside the tenant's allow-list is NOT_FOUND, exactly like one that does not exist
    hidden = _code(lambda: client.infer("digits", [inp], headers=_auth(gw.other)))
    missing = _code(lambda: client.infer("nope", [inp], headers=_auth(gw.acme)))
    assert hidden == missing == "StatusCode.NOT_FOUND"
    assert (
        _code(lambda: client.get_model_metadata("digits", headers=_auth(gw.other))) == "StatusCode.NOT_FOUND"
    )
    index = client.get_model_repository_index(headers=_auth(gw.other), as_json=True)
    assert index.get("models", []) == []
    index = client.get_model_repository_index(headers=_auth(gw.acme), as_json=True)
    assert [m["name"] for m in index["models"]] == ["digits"]


def test_one_limit_spent_over_http_and_grpc(gw, rows) -> None:  # noqa: ANN001
    """4 requests per minute: two over HTTP and two over gRPC are admitted, the fifth is refused."""
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": rows[0].tolist()}]}
    headers = {"Authorization": f"Bearer {gw.limited}"}
    client = triton_grpc.InferenceServerClient(gw.target)
    inp = triton_grpc.InferInput("input", [1, 64], "FP32")
    inp.set_data_from_numpy(rows[:1])
    assert httpx.post(f"{gw.url}/v2/models/digits/infer", json=body, headers=headers).status_code == 200
    client.infer("digits", [inp], headers=_auth(gw.limited))
    assert httpx.post(f"{gw.url}/v2/models/digits/infer", json=body, headers=headers).status_code == 200
    client.infer("digits", [inp], headers=_auth(gw.limited))
    with grpc.insecure_channel(gw.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="digits")
        tensor = request.inputs.add(name="input", datatype="FP32", shape=[1, 64])
        tensor.contents.fp32_contents.extend(rows[0].tolist())
        with pytest.raises(grpc.RpcError) as info:
            stub.ModelInfer(request, metadata=tuple(_auth(gw.limited).items()))
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailers = dict(info.value.trailing_metadata())
    assert int(trailers["retry-after"]) >= 1
    assert httpx.post(f"{gw.url}/v2/models/digits/infer", json=body, headers=headers).status_code == 429


# --- bad input --------------------------------------------------------------------------------------


def _infer_status(gw, request) -> tuple[grpc.StatusCode, str]:  # noqa: ANN001
    with grpc.insecure_channel(gw.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            stub.ModelInfer(request, metadata=tuple(_auth(gw.acme).items()))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def _request(shape: list[int], datatype: str = "FP32", raw: bytes | None = None, name: str = "input"):  # noqa: ANN202
    request = service_pb2.ModelInferRequest(model_name="digits")
    request.inputs.add(name=name, datatype=datatype, shape=shape)
    if raw is not None:
        request.raw_input_contents.append(raw)
    return request


def test_every_bad_input_is_a_clear_status(gw, rows) -> None:  # noqa: ANN001
    good = rows[:1].astype(np.float32).tobytes()
    cases = {
        "raw length": (_request([1, 64], raw=good[:-4]), "needs 256"),
        "wrong shape": (_request([1, 32], raw=good[:128]), "input"),
        "wrong dtype": (_request([1, 64], "FP64", raw=np.zeros(64).tobytes()), "input"),
        "unknown input": (_request([1, 64], raw=good, name="pixels"), "pixels"),
        "unknown datatype": (_request([1, 64], "FP8", raw=good), "FP8"),
        "zero dimension": (_request([0, 64], raw=b""), "dimension"),
        "typed count": (_typed([1, 64], [0.5] * 10), "10 values"),
        "bytes prefix": (_request([1], "BYTES", raw=struct.pack("<I", 99) + b"abc"), "ends early"),
        "raw count": (_two_raw(good), "raw_input_contents"),
        "no inputs": (service_pb2.ModelInferRequest(model_name="digits"), "no inputs"),
    }
    for name, (request, words) in cases.items():
        code, details = _infer_status(gw, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
        assert words in details, (name, details)
    # over the message size limit (server.max_body_bytes: 64 KiB)
    code, details = _infer_status(gw, _request([1, 64], raw=b"\0" * 100_000))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    # and the process still serves
    assert _infer_status(gw, _request([1, 64], raw=good))[0] == grpc.StatusCode.OK


def _typed(shape: list[int], values: list[float]):  # noqa: ANN202
    request = _request(shape)
    request.inputs[0].contents.fp32_contents.extend(values)
    return request


def _two_raw(good: bytes):  # noqa: ANN202
    request = _request([1, 64], raw=good)
    request.raw_input_contents.append(good)
    return request


def test_unimplemented_rpcs_say_so(gw) -> None:  # noqa: ANN001
    client = triton_grpc.InferenceServerClient(gw.target)
    with pytest.raises(InferenceServerException) as info:
        client.get_inference_statistics("digits", headers=_auth(gw.acme))
    assert info.value.status() == "StatusCode.UNIMPLEMENTED" and "/metrics" in info.value.message()


# --- non-finite values: refused as HTTP refuses them ----------------------------------------------


def test_nan_and_infinity_are_refused_like_http(gw, rows) -> None:  # noqa: ANN001
    """HTTP cannot carry NaN or infinity (JSON numbers are finite); gRPC answered OK with NaN outputs."""
    client = triton_grpc.InferenceServerClient(gw.target)
    for bad in (np.nan, np.inf, -np.inf):
        x = rows[:2].astype(np.float32).copy()
        x[1, 5] = bad
        inp = triton_grpc.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)  # raw_input_contents
        with pytest.raises(InferenceServerException) as info:
            client.infer("digits", [inp], headers=_auth(gw.acme))
        assert info.value.status() == "StatusCode.INVALID_ARGUMENT", (bad, info.value)
        assert "'input'" in info.value.message() and "finite" in info.value.message()
    for bad in (float("nan"), float("inf")):
        code, details = _infer_status(gw, _typed([1, 64], [0.5] * 63 + [bad]))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "finite" in details, (bad, code, details)
    assert _infer_status(gw, _request([1, 64], raw=rows[:1].astype(np.float32).tobytes()))[0] == grpc.StatusCode.OK


def test_tfserving_predict_refuses_nan_and_infinity(gw, rows) -> None:  # noqa: ANN001
    from tensorflow.core.framework import tensor_pb2, types_pb2
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    x = rows[:1].astype(np.float32).copy()
    x[0, 3] = np.nan
    by_content = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_content=x.tobytes())
    by_values = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[0.5] * 63 + [float("inf")])
    metadata = tuple(_auth(gw.acme).items())
    with grpc.insecure_channel(gw.target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        for proto in (by_content, by_values):
            proto.tensor_shape.dim.add(size=1)
            proto.tensor_shape.dim.add(size=64)
            request = predict_pb2.PredictRequest()
            request.model_spec.name = "digits"
            request.inputs["input"].CopyFrom(proto)
            with pytest.raises(grpc.RpcError) as info:
                stub.Predict(request, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert "finite" in info.value.details()
