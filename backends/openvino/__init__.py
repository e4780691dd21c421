"""OpenVINO adapter: IR (`.xml` + `.bin`) or ONNX files on CPU, GPU, AUTO or HETERO devices.

Inference runs on OpenVINO's own threads through an `AsyncInferQueue` sized from the compiled
model's OPTIMAL_NUMBER_OF_INFER_REQUESTS. The event loop never blocks: a request is started only
when the queue has an idle infer request (`start_async` would block otherwise), and OpenVINO's
completion callback hands the outputs back with `loop.call_soon_threadsafe`.

Precision is f32 unless the config asks for less: on CPUs with bf16 OpenVINO would otherwise
compute in bf16, which moves probabilities by up to 0.1.

Modules: `options`, `ports` (ports/tensors as v2 specs/arrays), `slots` (free infer requests),
`backend` (the Backend). `create` is the entry point named in backends/registry.py.
"""

from __future__ import annotations

from pathlib import Path

from backends.openvino.backend import OpenVINOBackend
from backends.openvino.options import OpenVINOOptions
from backends.spec import DeploymentSpec, decode_options

__all__ = ["OpenVINOBackend", "OpenVINOOptions", "create"]


def create(name: str, spec: DeploymentSpec) -> OpenVINOBackend:
    """Validate a deployment for OpenVINO; nothing heavy happens until `load()`.

    Raises:
        ValueError: the model file is missing or of an unknown kind, or an option is invalid.
    """
    if not spec.model:
        raise ValueError("model: an OpenVINO IR (.xml) or ONNX (.onnx) file is required for backend openvino")
    path = Path(spec.model)
    if path.suffix not in (".xml", ".onnx"):
        raise ValueError(f"model: {spec.model} must be an OpenVINO IR .xml or an .onnx file")
    if not path.is_file():
        raise ValueError(f"model: {spec.model} is not a file")
    if path.suffix == ".xml" and not path.with_suffix(".bin").is_file():
        raise ValueError(f"model: {path.with_suffix('.bin')} (the weights of {path.name}) is not a file")
    options = decode_options(spec.options, OpenVINOOptions)
    return OpenVINOBackend(name, spec, options)
