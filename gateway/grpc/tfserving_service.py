"""TF Serving's gRPC API over the gateway core: `PredictionService` (Predict, GetModelMetadata) and
`ModelService` (GetModelStatus), honouring `model_spec.version` and `model_spec.version_label`.

TensorProto in and out for every dtype the REST path takes. Classify, Regress and MultiInference
(which take tf.Example inputs) and HandleReloadConfigRequest answer UNIMPLEMENTED, as `:classify`
and `:regress` are refused on REST. Importing this module imports TensorFlow's protos (seconds).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

# TensorFlow's protos import its python package, which prints to stderr at import unless told not to
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from tensorflow.core.framework import tensor_pb2, tensor_shape_pb2, types_pb2  # noqa: E402
from tensorflow.core.protobuf import meta_graph_pb2  # noqa: E402
from tensorflow_serving.apis import (  # noqa: E402
    get_model_metadata_pb2,
    get_model_status_pb2,
    model_service_pb2_grpc,
    predict_pb2,
    prediction_service_pb2_grpc,
)

from backends.base import V2_TO_NUMPY, ModelMetadata, Tensor, TensorRequest, TensorSpec
from backends.errors import InvalidInput
from backends.runtime.validation import require_finite
from backends.tfserving.tensors import DT_TO_V2, V2_TO_DT, from_tensor_proto, to_tensor_proto
from gateway.core.calls import Call, ModelRef
from gateway.core.service import GatewayCore
from gateway.grpc.status import abort_with, metadata_of, trailing_metadata
from gateway.wire.credentials import bearer_key
from gateway.wire.v2_codec import MAX_RANK

PROTOCOL = "tfserving-grpc"
#: a TensorProto may shorten a tensor whose trailing values repeat; never expand one past this
MAX_EXPANDED_BYTES = 256 * 1024 * 1024


class _Decoded:
    def __init__(self, request: TensorRequest) -> None:
        self.request = request


def _model_ref(spec: Any) -> ModelRef:
    version = str(spec.version.value) if spec.HasField("version") else None
    label = spec.version_label or None
    if version is not None and label is not None:
        raise InvalidInput("model_spec: give version or version_label, not both")
    return ModelRef(spec.name, version, label)


def _array(name: str, proto: Any, spec: TensorSpec) -> np.ndarray:
    datatype = DT_TO_V2.get(proto.dtype)
    if datatype is None:
        raise InvalidInput(f"input {name!r}: unsupported TensorFlow dtype {proto.dtype}")
    if datatype != spec.datatype:
        raise InvalidInput(f"input {name!r}: dtype {datatype} given, the model takes {spec.datatype}")
    dims = [int(d.size) for d in proto.tensor_shape.dim]
    if proto.tensor_shape.unknown_rank or len(dims) > MAX_RANK or any(d < 1 for d in dims):
        raise InvalidInput(f"input {name!r}: shape {dims} must have 1..{MAX_RANK} dimensions, each >= 1")
    count = 1
    for d in dims:
        count *= d
        if count * V2_TO_NUMPY[datatype].itemsize > MAX_EXPANDED_BYTES:
            raise InvalidInput(f"input {name!r}: shape {dims} is larger than the gateway accepts")
    try:
        array = from_tensor_proto(proto)
    except (ValueError, OverflowError) as exc:  # a count that does not fit, a value out of range
        raise InvalidInput(f"input {name!r}: {exc}") from None
    if array.dtype.kind == "f":
        require_finite(array, name, datatype)
    return array


def decode_predict(message: Any, meta: ModelMetadata, request_id: str) -> _Decoded:
    specs = {s.name: s for s in meta.inputs}
    if not message.inputs:
        raise InvalidInput(f"the request has no inputs; the model's inputs are {sorted(specs)}")
    tensors = []
    for name, proto in message.inputs.items():
        spec = specs.get(name)
        if spec is None:
            raise InvalidInput(f"unknown input {name!r}; the model's inputs are {sorted(specs)}")
        array = _array(name, proto, spec)
        tensors.append(Tensor(name=name, datatype=spec.datatype, shape=tuple(array.shape), data=array))
    outputs = list(message.output_filter) or None
    return _Decoded(TensorRequest(id=request_id, inputs=tensors, outputs=outputs))


def _tensor_info(spec: TensorSpec) -> Any:
    shape = tensor_shape_pb2.TensorShapeProto(
        dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in spec.shape]
    )
    return meta_graph_pb2.TensorInfo(
        name=spec.name, dtype=V2_TO_DT.get(spec.datatype, types_pb2.DT_INVALID), tensor_shape=shape
    )


class _Base:
    def __init__(self, core: Callable[[], GatewayCore]) -> None:
        self._core = core

    def _call(self, context: Any) -> Call:
        metadata = metadata_of(context)
        return Call(PROTOCOL, metadata, bearer_key(metadata))


class PredictionService(_Base):
    async def Predict(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method names
        call = self._call(context)

        async def load(meta: ModelMetadata) -> _Decoded:
            return decode_predict(request, meta, call.request_id)

        try:
            model = _model_ref(request.model_spec)
            outcome = await self._core().serve_tensors(call, model, load)
            answer = predict_pb2.PredictResponse()
            answer.model_spec.name = model.name
            version = outcome.served.plan.version
            if version is not None and version.isdigit():
                answer.model_spec.version.value = int(version)
            for t in outcome.response.outputs:
                answer.outputs[t.name].CopyFrom(to_tensor_proto(tensor_pb2, np.asarray(t.data), t.datatype))
        except Exception as exc:  # noqa: BLE001 - answered as a gRPC status
            await abort_with(context, call, exc)
        context.set_trailing_metadata(trailing_metadata(outcome.served.response_headers(call)))
        call.done(200)
        return answer

    async def GetModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        call = self._call(context)
        try:
            fields = set(request.metadata_field)
            if fields - {"signature_def"}:
                raise InvalidInput(
                    f"metadata_field {sorted(fields - {'signature_def'})} is not served; ask for signature_def"
                )
            model = _model_ref(request.model_spec)
            view = await self._core().model_view(call, model)
            meta = view.metadata()
        except Exception as exc:  # noqa: BLE001
            await abort_with(context, call, exc)
        signature = meta_graph_pb2.SignatureDef(method_name="tensorflow/serving/predict")
        for s in meta.inputs:
            signature.inputs[s.name].CopyFrom(_tensor_info(s))
        for s in meta.outputs:
            signature.outputs[s.name].CopyFrom(_tensor_info(s))
        signatures = get_model_metadata_pb2.SignatureDefMap()
        signatures.signature_def["serving_default"].CopyFrom(signature)
        answer = get_model_metadata_pb2.GetModelMetadataResponse()
        answer.model_spec.name = model.name
        if view.version is not None and view.version.isdigit():
            answer.model_spec.version.value = int(view.version)
        answer.metadata["signature_def"].Pack(signatures)
        call.done(200)
        return answer

    async def Classify(self, request: Any, context: Any) -> Any:  # noqa: N802
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "fleetgate does not implement Classify; use Predict"
        )

    async def Regress(self, request: Any, context: Any) -> Any:  # noqa: N802
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "fleetgate does not implement Regress; use Predict"
        )

    async def MultiInference(self, request: Any, context: Any) -> Any:  # noqa: N802
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED, "fleetgate does not implement MultiInference; use Predict"
        )


class ModelService(_Base):
    async def GetModelStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        call = self._call(context)
        try:
            model = _model_ref(request.model_spec)
            core = self._core()
            view = await core.model_view(call, model)
            states = core.version_states(model.name, view.version)
        except Exception as exc:  # noqa: BLE001
            await abort_with(context, call, exc)
        answer = get_model_status_pb2.GetModelStatusResponse()
        state = get_model_status_pb2.ModelVersionStatus
        for version, ok in states:
            entry = answer.model_version_status.add()
            entry.version = int(version) if version and version.isdigit() else 1
            entry.state = state.AVAILABLE if ok else state.UNAVAILABLE
        call.done(200)
        return answer

    async def HandleReloadConfigRequest(self, request: Any, context: Any) -> Any:  # noqa: N802
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "models come from the gateway's config; change it and POST /admin/reload",
        )


def add_tfserving_services(core: Callable[[], GatewayCore], server: Any) -> list[str]:
    prediction_service_pb2_grpc.add_PredictionServiceServicer_to_server(PredictionService(core), server)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelService(core), server)
    return ["tensorflow.serving.PredictionService", "tensorflow.serving.ModelService"]
