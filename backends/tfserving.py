"""TensorFlow Serving adapter: the PredictionService gRPC API (`Predict`, `GetModelMetadata`).

The model's `signature_def` becomes v2 metadata (the signature's input and output keys are the
tensor names callers use), so requests are validated here before they travel. Tensors cross the
wire as TensorProtos built by hand from numpy (`tensor_content` for numbers, `string_val` for
BYTES): TensorFlow itself is never called in the gateway, only its generated protobuf modules.

gRPC status codes map to gateway errors: NOT_FOUND -> ModelNotFound (404), INVALID_ARGUMENT ->
InvalidInput (400), UNAVAILABLE -> BackendUnavailable (503, the router may fall back),
DEADLINE_EXCEEDED -> BackendTimeout (504), anything else -> BackendInternalError (500).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import structlog

from backends.base import (
    V2_TO_NUMPY,
    Capability,
    GenerateRequest,
    ModelMetadata,
    Tensor,
    TensorRequest,
    TensorResponse,
    TensorSpec,
)
from backends.batcher import Arrays, BatchObserver, DynamicBatcher, batcher_for
from backends.errors import (
    BackendError,
    BackendInternalError,
    BackendTimeout,
    BackendUnavailable,
    InvalidInput,
    ModelNotFound,
)
from backends.lazy import require
from backends.spec import DeploymentSpec, SpecBase
from backends.validation import validate_request

log = structlog.get_logger(__name__)

# --- TensorProto <-> numpy -------------------------------------------------------------------------

#: TensorFlow DataType enum value (tensorflow/core/framework/types.proto, wire-stable) -> v2 datatype
DT_TO_V2: dict[int, str] = {
    1: "FP32",  # DT_FLOAT
    2: "FP64",  # DT_DOUBLE
    3: "INT32",  # DT_INT32
    4: "UINT8",  # DT_UINT8
    5: "INT16",  # DT_INT16
    6: "INT8",  # DT_INT8
    7: "BYTES",  # DT_STRING
    9: "INT64",  # DT_INT64
    10: "BOOL",  # DT_BOOL
    17: "UINT16",  # DT_UINT16
    19: "FP16",  # DT_HALF
    22: "UINT32",  # DT_UINT32
    23: "UINT64",  # DT_UINT64
}
V2_TO_DT: dict[str, int] = {v: k for k, v in DT_TO_V2.items()}

#: the repeated field a TensorProto uses when it carries values without `tensor_content`
_VALUE_FIELD = {
    "FP32": "float_val",
    "FP64": "double_val",
    "INT32": "int_val",
    "INT16": "int_val",
    "INT8": "int_val",
    "UINT8": "int_val",
    "UINT16": "int_val",
    "INT64": "int64_val",
    "BOOL": "bool_val",
    "FP16": "half_val",  # the float16 bit patterns as ints
    "UINT32": "uint32_val",
    "UINT64": "uint64_val",
}


def to_tensor_proto(tensor_pb2: Any, array: np.ndarray, datatype: str) -> Any:
    """A numpy array as a TensorProto: raw little-endian bytes, or `string_val` for BYTES."""
    proto = tensor_pb2.TensorProto(dtype=V2_TO_DT[datatype])
    for size in array.shape:
        proto.tensor_shape.dim.add(size=int(size))
    if datatype == "BYTES":
        proto.string_val.extend(v if isinstance(v, bytes) else str(v).encode() for v in array.ravel())
    else:
        little = V2_TO_NUMPY[datatype].newbyteorder("<")
        proto.tensor_content = np.ascontiguousarray(array, dtype=little).tobytes()
    return proto


def from_tensor_proto(proto: Any) -> np.ndarray:
    """A TensorProto as a numpy array, whichever of its encodings the server chose.

    Raises:
        ValueError: an unsupported dtype or a value count that does not fit the shape.
    """
    datatype = DT_TO_V2.get(proto.dtype)
    if datatype is None:
        raise ValueError(f"unsupported TensorFlow dtype {proto.dtype}")
    shape = tuple(int(d.size) for d in proto.tensor_shape.dim)
    count = int(np.prod(shape, dtype=np.int64))
    dtype = V2_TO_NUMPY[datatype]
    if datatype != "BYTES" and proto.tensor_content:
        flat = np.frombuffer(proto.tensor_content, dtype=dtype.newbyteorder("<")).astype(dtype)
    elif datatype == "BYTES":
        flat = np.empty(len(proto.string_val), dtype=object)
        flat[:] = list(proto.string_val)
    elif datatype == "FP16":
        flat = np.asarray(proto.half_val, dtype=np.uint16).view(np.float16)
    else:
        flat = np.asarray(getattr(proto, _VALUE_FIELD[datatype]), dtype=dtype)
    if flat.size != count:
        # TensorFlow's own encoding may shorten a tensor whose trailing values repeat the last one.
        if flat.size == 0 or flat.size > count or datatype != "BYTES" and proto.tensor_content:
            raise ValueError(f"tensor holds {flat.size} values, shape {list(shape)} needs {count}")
        flat = np.concatenate([flat, np.repeat(flat[-1:], count - flat.size)])
    return flat.reshape(shape)


def zeros_for(spec: TensorSpec) -> np.ndarray:
    """A zero tensor matching a spec, with dynamic dimensions set to 1 (for warm-up)."""
    shape = tuple(1 if d == -1 else d for d in spec.shape)
    if spec.datatype == "BYTES":
        return np.full(shape, b"", dtype=object)
    return np.zeros(shape, V2_TO_NUMPY[spec.datatype])


class TFServingOptions(SpecBase):
    """`options:` of a tfserving deployment."""

    #: pin a model version (default: the server's latest); exclusive with `version_label`
    version: int | None = None
    #: a version label such as "stable" or "canary"
    version_label: str | None = None
    signature_name: str = "serving_default"
    #: largest gRPC message sent or received
    max_message_bytes: int = 64 * 1024 * 1024
    #: gRPC channels (one TCP connection each) requests are spread over
    channels: int = 1
    #: with batching: merged batches sent at the same time (the server runs Predicts in parallel)
    parallel_batches: int = 2

    def __post_init__(self) -> None:
        if self.version is not None and self.version_label is not None:
            raise ValueError("set either version or version_label, not both")
        if self.version is not None and self.version < 1:
            raise ValueError("version must be >= 1")
        if self.channels < 1:
            raise ValueError("channels must be >= 1")
        if self.parallel_batches < 1:
            raise ValueError("parallel_batches must be >= 1")
        if self.max_message_bytes < 4096:
            raise ValueError("max_message_bytes must be >= 4096")


def _load_apis() -> SimpleNamespace:
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


def _spec_of(key: str, info: Any) -> TensorSpec:
    datatype = DT_TO_V2.get(info.dtype)
    if datatype is None:
        raise RuntimeError(
            f"signature tensor {key!r} has TensorFlow dtype {info.dtype}, which the gateway cannot serve"
        )
    if info.tensor_shape.unknown_rank:
        raise RuntimeError(
            f"signature tensor {key!r} has an unknown rank; export the model with a fixed rank"
        )
    return TensorSpec(name=key, datatype=datatype, shape=tuple(int(d.size) for d in info.tensor_shape.dim))


class TFServingBackend:
    """Forwards tensor requests to a TensorFlow Serving server over pooled gRPC channels."""

    capabilities = frozenset({Capability.TENSOR})

    def __init__(self, name: str, spec: DeploymentSpec, options: TFServingOptions) -> None:
        self.name = name
        self.spec = spec
        self.options = options
        self.target = str(spec.target)
        self.model_name = spec.model_name or name
        self.batch_observer: BatchObserver | None = None
        self._apis: SimpleNamespace | None = None
        self._channels: list[Any] = []
        self._stubs: list[Any] = []
        self._next = 0
        self._meta: ModelMetadata | None = None
        self._batcher: DynamicBatcher | None = None
        self._down = False  # the last call found the server unreachable
        self._connect_task: asyncio.Task[None] | None = None

    @property
    def ready(self) -> bool:
        """False while the server cannot be reached; a later successful connection clears it."""
        if self._meta is None or not self._channels:
            return False
        connectivity = self._apis.grpc.ChannelConnectivity  # type: ignore[union-attr]
        # try_to_connect nudges idle channels to reconnect, so readiness recovers on its own.
        states = [ch.get_state(try_to_connect=self._down) for ch in self._channels]
        if all(st in (connectivity.TRANSIENT_FAILURE, connectivity.SHUTDOWN) for st in states):
            return False
        if self._down and connectivity.READY in states:
            self._down = False
        return not self._down

    @property
    def queue_depth(self) -> int:
        return self._batcher.depth if self._batcher else 0

    def metadata(self) -> ModelMetadata:
        if self._meta is None:
            raise BackendUnavailable(f"deployment {self.name!r}: TF Serving at {self.target} not reached yet")
        return self._meta

    def _model_spec(self, message: Any, *, signature: bool) -> None:
        message.name = self.model_name
        if self.options.version is not None:
            message.version.value = self.options.version
        elif self.options.version_label is not None:
            message.version_label = self.options.version_label
        if signature:
            message.signature_name = self.options.signature_name

    async def load(self) -> None:
        """Open the channels and read the signature from GetModelMetadata.

        A server that cannot be reached yet does not fail the load: the deployment stays not
        ready (requests get 503, so the router can fall back) while a background task keeps
        asking for the metadata with backoff.

        Raises:
            ModelNotFound: the server has no such model, version or label.
            RuntimeError: the signature is missing or cannot be served.
        """
        apis = self._apis = await asyncio.to_thread(_load_apis)
        size = self.options.max_message_bytes
        channel_options = [
            ("grpc.max_send_message_length", size),
            ("grpc.max_receive_message_length", size),
            # Each channel gets its own connection; with the global pool they would share one.
            ("grpc.use_local_subchannel_pool", 1),
            # gRPC's default reconnect backoff grows to 120 s; a restarted server should be
            # noticed within seconds.
            ("grpc.initial_reconnect_backoff_ms", 500),
            ("grpc.min_reconnect_backoff_ms", 500),
            ("grpc.max_reconnect_backoff_ms", 5000),
        ]
        self._channels = [
            apis.grpc.aio.insecure_channel(self.target, options=channel_options)
            for _ in range(self.options.channels)
        ]
        self._stubs = [apis.service.PredictionServiceStub(ch) for ch in self._channels]
        try:
            await self._fetch_metadata()
        except BackendUnavailable as exc:
            log.warning("tfserving_unreachable_at_load", deployment=self.name, error=exc.message)
            self._connect_task = asyncio.create_task(
                self._connect_later(), name=f"tfserving-connect-{self.name}"
            )

    async def _connect_later(self) -> None:
        """Retry GetModelMetadata until the server answers (or the deployment closes)."""
        delay = 0.5
        while self._meta is None and self._channels:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
            try:
                await self._fetch_metadata()
            except BackendUnavailable:
                continue
            except Exception as exc:  # noqa: BLE001 - a permanent error: reported, not retried
                log.error("tfserving_load_failed", deployment=self.name, error=str(exc))
                return

    async def _fetch_metadata(self) -> None:
        apis = self._apis
        assert apis is not None
        request = apis.metadata.GetModelMetadataRequest(metadata_field=["signature_def"])
        self._model_spec(request.model_spec, signature=False)
        response = await self._call("GetModelMetadata", request)
        sig_map = apis.metadata.SignatureDefMap()
        response.metadata["signature_def"].Unpack(sig_map)
        signature = self.options.signature_name
        if signature not in sig_map.signature_def:
            known = sorted(sig_map.signature_def)
            raise RuntimeError(
                f"TF Serving model {self.model_name!r} has no signature {signature!r} (it has {known})"
            )
        sig = sig_map.signature_def[signature]
        inputs = [_spec_of(k, sig.inputs[k]) for k in sorted(sig.inputs)]
        outputs = [_spec_of(k, sig.outputs[k]) for k in sorted(sig.outputs)]
        version = str(response.model_spec.version.value) if response.model_spec.HasField("version") else ""
        self._meta = ModelMetadata(
            name=self.name,
            platform="tensorflow_savedmodel",
            inputs=inputs,
            outputs=outputs,
            device="remote",
            versions=[version] if version else [],
            extra={
                "target": self.target,
                "model_name": self.model_name,
                "version_label": self.options.version_label,
                "signature_name": signature,
                "channels": len(self._channels),
            },
        )
        log.info("tfserving_loaded", deployment=self.name, **self._meta.extra, version=version)
        if self.spec.batching is not None:
            self._batcher = batcher_for(
                self.name,
                self.spec.batching,
                inputs + outputs,
                self._run_async,
                lambda: self.batch_observer,
                max_in_flight=self.options.parallel_batches,
            )

    async def _call(self, method: str, request: Any) -> Any:
        """One RPC with the deployment's deadline; failures become gateway errors."""
        if not self._stubs or self._apis is None:
            raise BackendUnavailable(f"deployment {self.name!r} is not loaded")
        stub = self._pick_stub()
        try:
            response = await getattr(stub, method)(request, timeout=self.spec.timeout_s)
        except self._apis.grpc.aio.AioRpcError as exc:
            error = map_rpc_error(exc, f"TF Serving {self.target} {method}")
            self._down = isinstance(error, BackendUnavailable)
            raise error from None
        self._down = False
        return response

    def _pick_stub(self) -> Any:
        """Round robin over the channels, skipping those in connection backoff (they fail fast)."""
        failing = self._apis.grpc.ChannelConnectivity.TRANSIENT_FAILURE  # type: ignore[union-attr]
        count = len(self._stubs)
        for step in range(count):
            index = (self._next + step) % count
            if self._channels[index].get_state(try_to_connect=True) != failing:
                break
        else:
            index = self._next % count
        self._next = index + 1
        return self._stubs[index]

    async def warmup(self) -> None:
        """One request of zeros: opens the connection and runs the model once."""
        if self._meta is None:  # not reached yet; the background connect will load the metadata
            return
        feeds = {s.name: zeros_for(s) for s in self.metadata().inputs}
        await self._run_async(feeds, None)

    async def close(self) -> None:
        if self._connect_task is not None:
            self._connect_task.cancel()
            self._connect_task = None
        if self._batcher is not None:
            await self._batcher.close()
            self._batcher = None
        channels, self._channels, self._stubs = self._channels, [], []
        for channel in channels:
            await channel.close()

    async def infer(self, request: TensorRequest) -> TensorResponse:
        arrays = validate_request(request, self.metadata())
        outputs = tuple(request.outputs) if request.outputs is not None else None
        if self._batcher is not None:
            result = await self._batcher.submit(arrays, outputs)
        else:
            result = await self._run_async(arrays, outputs)
        return TensorResponse(id=request.id, outputs=[Tensor.from_array(n, a) for n, a in result.items()])

    async def _run_async(self, inputs: Arrays, outputs: tuple[str, ...] | None) -> Arrays:
        apis = self._apis
        if apis is None:
            raise BackendUnavailable(f"deployment {self.name!r} is not loaded")
        specs = {s.name: s for s in self.metadata().inputs}
        request = apis.predict.PredictRequest()
        self._model_spec(request.model_spec, signature=True)
        for name, array in inputs.items():
            request.inputs[name].CopyFrom(to_tensor_proto(apis.tensor, array, specs[name].datatype))
        if outputs is not None:
            request.output_filter.extend(outputs)
        response = await self._call("Predict", request)
        names = outputs if outputs is not None else tuple(s.name for s in self.metadata().outputs)
        missing = [n for n in names if n not in response.outputs]
        if missing:
            raise BackendInternalError(
                f"TF Serving {self.target} Predict: response lacks output(s) {missing}"
            )
        try:
            return {n: from_tensor_proto(response.outputs[n]) for n in names}
        except ValueError as exc:
            raise BackendInternalError(f"TF Serving {self.target} Predict: {exc}") from None

    async def abort(self, request_id: str) -> None:  # a Predict cannot be aborted once sent
        return None

    def generate(self, request: GenerateRequest):  # type: ignore[no-untyped-def]
        raise InvalidInput(f"deployment {self.name!r} serves tensors, not text generation")


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
    try:
        options = msgspec.convert(spec.options, TFServingOptions)
    except msgspec.ValidationError as exc:
        raise ValueError(f"options: {str(exc).replace('`$', '`options')}") from None
    return TFServingBackend(name, spec, options)
