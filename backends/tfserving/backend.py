"""The TF Serving backend: pooled gRPC channels, metadata from the signature, Predict with deadlines."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import structlog

from backends.base import (
    BatchObserver,
    Capability,
    ModelMetadata,
    TensorRequest,
    TensorResponse,
)
from backends.errors import BackendInternalError, BackendUnavailable
from backends.runtime.batcher import Arrays, DynamicBatcher, batcher_for
from backends.runtime.tensor_requests import serve_tensor_request, zero_inputs
from backends.spec import DeploymentSpec
from backends.tfserving.options import TFServingOptions
from backends.tfserving.rpc import load_apis, map_rpc_error
from backends.tfserving.tensors import from_tensor_proto, signature_spec, to_tensor_proto

log = structlog.get_logger(__name__)


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
        apis = self._apis = await asyncio.to_thread(load_apis)
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
        inputs = [signature_spec(k, sig.inputs[k]) for k in sorted(sig.inputs)]
        outputs = [signature_spec(k, sig.outputs[k]) for k in sorted(sig.outputs)]
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
        await self._run_async(zero_inputs(self.metadata()), None)

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
        return await serve_tensor_request(request, self.metadata(), self._batcher, self._run_async)

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
