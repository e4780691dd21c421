"""gRPC plumbing: the lazily imported TF Serving stubs and the status-code -> gateway-error map."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import structlog

from backends.errors import (
    BackendError,
    BackendInternalError,
    BackendTimeout,
    BackendUnavailable,
    InvalidInput,
    ModelNotFound,
)
from backends.runtime.lazy import require

log = structlog.get_logger(__name__)

#: lines TensorFlow's native logging writes while it is imported (absl's `I0000 00:00:...` lines,
#: its notice about logs before absl is set up, the CPU-instructions hint): the CUDA probe and
#: similar notes, meaningless here, where only TF's generated protobuf modules are used
_TF_NATIVE_LINE = re.compile(
    r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d|WARNING: All log messages before absl::InitializeLog|"
    r"To enable the following instructions:|\S*\.cc:\d+\])"
)


def load_apis() -> SimpleNamespace:
    """Import gRPC and the TF Serving protos (seconds: they import TensorFlow's python package).

    TensorFlow's start-up messages (its CUDA probe on a machine without a GPU, CPU feature hints)
    become one debug log line instead of stderr noise: its C++ log level is set to errors-only
    unless the operator set `TF_CPP_MIN_LOG_LEVEL`, and what its native code still writes to
    stderr before that level applies is caught during the import.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    grpc = require("grpc", extra="tfserving")
    require("grpc.aio", extra="tfserving")
    apis = "tensorflow_serving.apis."
    with _native_stderr_caught() as caught:
        loaded = SimpleNamespace(
            grpc=grpc,
            predict=require(apis + "predict_pb2", extra="tfserving"),
            metadata=require(apis + "get_model_metadata_pb2", extra="tfserving"),
            service=require(apis + "prediction_service_pb2_grpc", extra="tfserving"),
            tensor=require("tensorflow.core.framework.tensor_pb2", extra="tfserving"),
        )
    tf_lines = [line for line in caught if _TF_NATIVE_LINE.match(line)]
    others = [line for line in caught if not _TF_NATIVE_LINE.match(line)]
    if others:  # not TensorFlow's start-up notes (another thread's output): passed on unchanged
        sys.stderr.write("".join(f"{line}\n" for line in others))
    if tf_lines:
        log.debug("tensorflow_import_messages", lines=tf_lines)
    return loaded


@contextlib.contextmanager
def _native_stderr_caught() -> Iterator[list[str]]:
    """Point file descriptor 2 at a temporary file while the block runs (native code writes there,
    not to `sys.stderr`); the list holds the lines written, once the block is over."""
    lines: list[str] = []
    saved: int | None = None
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no stderr: nothing to catch
        sys.stderr.flush()
        saved = os.dup(2)
    if saved is None:
        yield lines
        return
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield lines
        finally:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            lines += sink.read().decode("utf-8", "replace").splitlines()


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
