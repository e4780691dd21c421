"""TF Serving's gRPC services are listed from the start but TensorFlow is imported by their first call
(gateway/grpc/tfserving_lazy.py): a `fleetgate serve` process has no TensorFlow library mapped until a
TF Serving client calls, and that first call is answered as every later one."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import numpy as np
import pytest

from backends.demo_models.digits import digits_split
from tests.conftest import create_key
from tests.servers import free_port
from tests.tenancy.conftest import start_gateway, wait_ready

pytestmark = pytest.mark.slow


def _tensorflow_loaded(pid: int) -> bool:
    """Whether the process has TensorFlow's shared library mapped (importing its protos loads it)."""
    return "tensorflow" in Path(f"/proc/{pid}/maps").read_text()


def _predict(target: str, key: str, rows: np.ndarray) -> np.ndarray:
    from tensorflow.core.framework import tensor_pb2, types_pb2
    from tensorflow_serving.apis import predict_pb2, prediction_service_pb2_grpc

    request = predict_pb2.PredictRequest()
    request.model_spec.name = "digits"
    proto = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_content=rows.tobytes())
    proto.tensor_shape.dim.add(size=rows.shape[0])
    proto.tensor_shape.dim.add(size=rows.shape[1])
    request.inputs["input"].CopyFrom(proto)
    with grpc.insecure_channel(target) as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        answer = stub.Predict(request, metadata=(("authorization", f"Bearer {key}"),), timeout=120)
    return np.frombuffer(answer.outputs["probabilities"].tensor_content, np.float32).reshape(len(rows), 10)


def test_tensorflow_is_imported_by_the_first_tfserving_call(digits, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    pytest.importorskip("tensorflow_serving.apis")
    port = free_port()
    monkeypatch.setenv("FLEETGATE_GRPC_PORT", str(port))
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"""
server: {{drain_grace_s: 0}}
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments: {{ort: {{backend: onnxruntime, model: {digits.onnx_path}}}}}
models: {{digits: {{routes: [{{deployment: ort}}]}}}}
"""
    )
    gw = start_gateway(config, tmp_path / "gateway.log")
    try:
        wait_ready(gw, timeout_s=120)
        assert not _tensorflow_loaded(gw.proc.pid), "TensorFlow was imported at start"
        key = create_key(gw.url, "acme")
        rows = digits_split()[1][:4]
        first, again = _predict(f"127.0.0.1:{port}", key, rows), _predict(f"127.0.0.1:{port}", key, rows)
        assert first.shape == (4, 10) and np.array_equal(first, again)
        np.testing.assert_allclose(first.sum(axis=1), 1.0, atol=1e-5)  # probabilities
        assert _tensorflow_loaded(gw.proc.pid)
    finally:
        gw.kill(signal.SIGTERM)
