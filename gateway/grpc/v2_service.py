"""KServe v2 / Triton `inference.GRPCInferenceService` over the gateway core.

Served: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelInfer (typed and raw
contents, model versions), and, of Triton's extensions that `tritonclient.grpc` and perf_analyzer
call, ModelConfig (built from the deployment's metadata) and RepositoryIndex (the caller's visible
models). Every other RPC answers UNIMPLEMENTED with what fleetgate offers instead.
"""

from __future__ import annotations

from typing import Any

import grpc

from backends.base import ModelMetadata
from gateway.core.calls import Call, ModelRef
from gateway.core.results import ModelView
from gateway.core.service import GatewayCore
from gateway.grpc.status import abort_with, metadata_of, trailing_metadata
from gateway.grpc.v2_codec import DecodedModelInfer, decode_model_infer, encode_model_infer
from gateway.wire.credentials import bearer_key
from gateway.wire.v2_codec import SERVER_NAME, SERVER_VERSION

PROTOCOL = "v2-grpc"


class InferenceService:
    """The servicer; `pb` and `config_pb` are tritonclient's generated service and model-config modules."""

    def __init__(self, core: Any, pb: Any, config_pb: Any) -> None:
        #: a callable returning the live core (reloads replace nothing, but tests build several apps)
        self._core = core
        self.pb = pb
        self.config_pb = config_pb

    @property
    def core(self) -> GatewayCore:
        return self._core()

    def _call(self, context: Any) -> Call:
        metadata = metadata_of(context)
        return Call(PROTOCOL, metadata, bearer_key(metadata))

    # --- health and metadata ---------------------------------------------------------------

    async def ServerLive(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC method names
        return self.pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        return self.pb.ServerReadyResponse(ready=self.core.ready())

    async def ServerMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        return self.pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=[])

    async def ModelReady(self, request: Any, context: Any) -> Any:  # noqa: N802
        call = self._call(context)
        try:
            view = await self.core.model_view(call, ModelRef(request.name, request.version or None))
        except Exception as exc:  # noqa: BLE001 - answered as a gRPC status
            await abort_with(context, call, exc)
        call.done(200)
        return self.pb.ModelReadyResponse(ready=view.ready)

    async def _described(self, request: Any, context: Any) -> tuple[Call, ModelView, ModelMetadata]:
        """The call, the model's view and its metadata for a (name, version) request; aborts on error."""
        call = self._call(context)
        try:
            view = await self.core.model_view(call, ModelRef(request.name, request.version or None))
            return call, view, view.metadata()
        except Exception as exc:  # noqa: BLE001
            await abort_with(context, call, exc)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:  # noqa: N802
        call, view, meta = await self._described(request, context)
        spec = self.pb.ModelMetadataResponse.TensorMetadata
        call.done(200)
        return self.pb.ModelMetadataResponse(
            name=view.name,
            versions=view.versions or ["1"],
            platform=meta.platform,
            inputs=[spec(name=s.name, datatype=s.datatype, shape=list(s.shape)) for s in meta.inputs],
            outputs=[spec(name=s.name, datatype=s.datatype, shape=list(s.shape)) for s in meta.outputs],
        )

    async def ModelConfig(self, request: Any, context: Any) -> Any:  # noqa: N802
        """What fleetgate knows of the model as a Triton model config: its tensors, no batching
        promises (`max_batch_size` 0: shapes are given in full, -1 where dynamic)."""
        call, view, meta = await self._described(request, context)
        cfg = self.config_pb

        def dtype(datatype: str) -> int:
            return cfg.DataType.Value("TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}")

        call.done(200)
        config = cfg.ModelConfig(
            name=view.name,
            platform=meta.platform,
            max_batch_size=0,
            input=[
                cfg.ModelInput(name=s.name, data_type=dtype(s.datatype), dims=list(s.shape))
                for s in meta.inputs
            ],
            output=[
                cfg.ModelOutput(name=s.name, data_type=dtype(s.datatype), dims=list(s.shape))
                for s in meta.outputs
            ],
        )
        return self.pb.ModelConfigResponse(config=config)

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:  # noqa: N802
        """The models this caller may use, READY or UNAVAILABLE (a tenant sees only its own)."""
        call = self._call(context)
        core = self.core
        try:
            principal = await core.identify(call)
        except Exception as exc:  # noqa: BLE001
            await abort_with(context, call, exc)
        index = self.pb.RepositoryIndexResponse.ModelIndex
        models = []
        for name in core.visible_models(principal):
            state = "READY" if any(ok for _, ok in core.version_states(name, None)) else "UNAVAILABLE"
            if request.ready and state != "READY":
                continue
            models.append(index(name=name, version="", state=state))
        call.done(200)
        return self.pb.RepositoryIndexResponse(models=models)

    # --- inference -------------------------------------------------------------------------

    async def ModelInfer(self, request: Any, context: Any) -> Any:  # noqa: N802
        call = self._call(context)
        model = ModelRef(request.model_name, request.model_version or None)

        async def load(meta: Any) -> DecodedModelInfer:
            return decode_model_infer(request, call.request_id)

        try:
            outcome = await self.core.serve_tensors(call, model, load)
            plan = outcome.served.plan
            answer = encode_model_infer(
                self.pb, outcome.response, model.name, plan.version, outcome.decoded.client_id
            )
        except Exception as exc:  # noqa: BLE001
            await abort_with(context, call, exc)
        context.set_trailing_metadata(trailing_metadata(outcome.served.response_headers(call)))
        call.done(200)
        return answer


def _unimplemented(name: str, instead: str) -> Any:
    async def method(self: InferenceService, request: Any, context: Any) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"fleetgate does not implement {name}; {instead}")

    method.__name__ = name
    return method


_NOT_OFFERED = {
    "ModelStreamInfer": "send unary ModelInfer calls (streams are served on the OpenAI endpoints)",
    "ModelStatistics": "per-model statistics are on /metrics (fleetgate_requests_total and friends)",
    "RepositoryModelLoad": "deployments are loaded from the config; change it and reload (POST /admin/reload)",
    "RepositoryModelUnload": "deployments are loaded from the config; change it and reload (POST /admin/reload)",
    "SystemSharedMemoryStatus": "shared memory is not offered; send tensors in the request",
    "SystemSharedMemoryRegister": "shared memory is not offered; send tensors in the request",
    "SystemSharedMemoryUnregister": "shared memory is not offered; send tensors in the request",
    "CudaSharedMemoryStatus": "CUDA shared memory is not offered; send tensors in the request",
    "CudaSharedMemoryRegister": "CUDA shared memory is not offered; send tensors in the request",
    "CudaSharedMemoryUnregister": "CUDA shared memory is not offered; send tensors in the request",
    "TraceSetting": "tracing is configured on the gateway, not per call",
    "LogSettings": "logging is configured by server.log_level",
}
for _name, _instead in _NOT_OFFERED.items():
    setattr(InferenceService, _name, _unimplemented(_name, _instead))
