"""One model, every runtime: ONNX Runtime, OpenVINO and TF Serving agree on the digits test split."""

from __future__ import annotations

import numpy as np

from backends import openvino as ov_backend
from backends import tfserving
from backends.base import Tensor, TensorRequest
from backends.spec import DeploymentSpec

TOLERANCE = 1e-4


async def _outputs(backend, x: np.ndarray) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    response = await backend.infer(TensorRequest(id="p", inputs=[Tensor.from_array("input", x)]))
    return {t.name: t.data for t in response.outputs}


async def test_same_outputs_and_top1_on_every_runtime(digits, digits_onnx, digits_ir, tfs_server, request):
    import onnxruntime as ort

    record_property = request.node.user_properties.append

    x = digits.x_test  # the whole test split, one batch
    session = ort.InferenceSession(str(digits_onnx), providers=["CPUExecutionProvider"])
    ref_probs, ref_label = session.run(["probabilities", "label"], {"input": x})

    results: dict[str, dict[str, np.ndarray]] = {}
    for name, spec in {
        "openvino_ir": DeploymentSpec(backend="openvino", model=str(digits_ir)),
        "openvino_onnx": DeploymentSpec(backend="openvino", model=str(digits_onnx)),
        "tfserving": DeploymentSpec(
            backend="tfserving", target=tfs_server.target, model_name="digits", options={"version": 1}
        ),
    }.items():
        module = tfserving if spec.backend == "tfserving" else ov_backend
        backend = module.create(f"digits-{name}", spec)
        await backend.load()
        try:
            results[name] = await _outputs(backend, x)
        finally:
            await backend.close()

    accuracy = float((ref_label == digits.y_test).mean())
    record_property(("digits_test_accuracy", accuracy))
    record_property(("digits_test_rows", len(x)))
    assert accuracy > 0.9, accuracy  # a trained model: top-1 agreement means something
    for name, out in results.items():
        diff = float(np.abs(out["probabilities"] - ref_probs).max())
        record_property((f"max_abs_diff_{name}", diff))
        assert out["probabilities"].dtype == np.float32
        assert diff < TOLERANCE, (name, diff)
        assert out["label"].dtype == np.int64
        np.testing.assert_array_equal(out["label"], ref_label, err_msg=name)
        np.testing.assert_array_equal(out["probabilities"].argmax(axis=1), ref_label, err_msg=name)
