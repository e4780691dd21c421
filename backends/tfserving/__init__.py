"""TensorFlow Serving adapter: the PredictionService gRPC API (`Predict`, `GetModelMetadata`).

The model's `signature_def` becomes v2 metadata (the signature's input and output keys are the
tensor names callers use), so requests are validated here before they travel. Tensors cross the
wire as TensorProtos built by hand from numpy (`tensor_content` for numbers, `string_val` for
BYTES): TensorFlow itself is never called in the gateway, only its generated protobuf modules.

gRPC status codes map to gateway errors: NOT_FOUND -> ModelNotFound (404), INVALID_ARGUMENT ->
InvalidInput (400), UNAVAILABLE -> BackendUnavailable (503, the router may fall back),
DEADLINE_EXCEEDED -> BackendTimeout (504), anything else -> BackendInternalError (500).

Modules: `tensors` (TensorProto <-> numpy, dtypes), `rpc` (stubs, status codes), `options`,
`backend` (the Backend). `create` is the entry point named in backends/registry.py.
"""

from __future__ import annotations

from backends.runtime.tensor_requests import zeros_for
from backends.spec import DeploymentSpec, decode_options
from backends.tfserving.backend import TFServingBackend
from backends.tfserving.options import TFServingOptions
from backends.tfserving.rpc import map_rpc_error
from backends.tfserving.tensors import DT_TO_V2, V2_TO_DT, from_tensor_proto, to_tensor_proto

__all__ = [
    "DT_TO_V2",
    "V2_TO_DT",
    "TFServingBackend",
    "TFServingOptions",
    "create",
    "from_tensor_proto",
    "map_rpc_error",
    "to_tensor_proto",
    "zeros_for",
]


def create(name: str, spec: DeploymentSpec) -> TFServingBackend:
    """Validate a deployment for TF Serving; no connection is made until `load()`.

    Raises:
        ValueError: `target` is not host:port, or an option is invalid.
    """
    if not spec.target:
        raise ValueError(
            "target: host:port of the TF Serving gRPC endpoint is required for backend tfserving"
        )
    host, sep, port = spec.target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target: {spec.target!r} is not host:port")
    if spec.timeout_s <= 0:
        raise ValueError("timeout_s must be > 0")
    options = decode_options(spec.options, TFServingOptions)
    return TFServingBackend(name, spec, options)
