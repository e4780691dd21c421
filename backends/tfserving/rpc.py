"""gRPC plumbing: the lazily imported TF Serving stubs and the status-code -> gateway-error map."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from backends.errors import (
    BackendError,
    BackendInternalError,
    BackendTimeout,
    BackendUnavailable,
    InvalidInput,
    ModelNotFound,
)
from backends.lazy import require


def load_apis() -> SimpleNamespace:
    """Import gRPC and the TF Serving protos (seconds: they import TensorFlow's python package)."""
    grpc = require("grpc", extra="tfserving")
    require("grpc.aio", extra="tfserving")
    apis = "tensorflow_serving.apis."
    return SimpleNamespace(
        grpc=grpc,
        predict=require(apis + "predict_pb2", extra="tfserving"),
        metadata=require(apis + "get_model_metadata_pb2", extra="tfserving"),
        service=require(apis + "prediction_service_pb2_grpc", extra="tfserving"),
        tensor=require("tensorflow.core.framework.tensor_pb2", extra="tfserving"),
    )


def map_rpc_error(exc: Any, what: str) -> BackendError:
    """Translate a grpc.aio.AioRpcError into the gateway error for its status code."""
    code = exc.code()
    name = getattr(code, "name", str(code))
    details = (exc.details() or "").strip().splitlines()
    text = f"{what}: {name}: {details[0][:300] if details else 'no details'}"
    if name == "NOT_FOUND":
        return ModelNotFound(text)
    if name == "INVALID_ARGUMENT":
        return InvalidInput(text)
    if name == "UNAVAILABLE":
        return BackendUnavailable(text)
    if name == "DEADLINE_EXCEEDED":
        return BackendTimeout(text)
    return BackendInternalError(text)
