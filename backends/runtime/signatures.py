"""A model file's inputs and outputs, read without loading the model (for config checks).

`fleetgate check-config` and start-up check graphs' tensor mappings before any runtime is loaded:
an ONNX file's graph declares its tensors (read with the `onnx` package, weights left on disk),
an OpenVINO model's too (`read_model`, no compilation). Other backends (TF Serving, remote
upstreams, LLMs) are known only once loaded: None.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import structlog

from backends.base import NUMPY_TO_V2, ModelMetadata, TensorSpec
from backends.spec import DeploymentSpec

log = structlog.get_logger(__name__)


def _onnx_spec(value: Any, onnx: Any) -> TensorSpec | None:
    tensor_type = value.type.tensor_type
    try:
        datatype = NUMPY_TO_V2.get(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)))
    except (KeyError, TypeError, ValueError):
        return None
    if datatype is None:
        return None
    dims = tuple(d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim)
    return TensorSpec(name=value.name, datatype=datatype, shape=dims)


def _onnx_signature(path: str) -> ModelMetadata | None:
    if importlib.util.find_spec("onnx") is None:
        return None
    import onnx

    model = onnx.load(path, load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    inputs = [_onnx_spec(v, onnx) for v in model.graph.input if v.name not in initializers]
    outputs = [_onnx_spec(v, onnx) for v in model.graph.output]
    if any(s is None for s in (*inputs, *outputs)):
        return None  # a type the gateway cannot serve: the deployment's load says so
    return ModelMetadata(name=path, platform="onnx", inputs=inputs, outputs=outputs)  # type: ignore[arg-type]


def _openvino_signature(path: str) -> ModelMetadata | None:
    if importlib.util.find_spec("openvino") is None:
        return None
    import openvino as ov

    from backends.openvino.ports import port_spec

    model = ov.Core().read_model(path)
    return ModelMetadata(
        name=path,
        platform="openvino",
        inputs=[port_spec(p) for p in model.inputs],
        outputs=[port_spec(p) for p in model.outputs],
    )


def read_signature(spec: DeploymentSpec) -> ModelMetadata | None:
    """The tensors of a deployment's model file where they can be read cheaply, else None.

    Never raises: a file that cannot be read is the deployment's own load error, reported there.
    """
    if spec.model is None:
        return None
    try:
        if spec.backend == "onnxruntime":
            return _onnx_signature(spec.model)
        if spec.backend == "openvino":
            return _openvino_signature(spec.model)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        log.debug("signature_unreadable", model=spec.model, error=str(exc))
    return None
