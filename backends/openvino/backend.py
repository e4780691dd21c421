"""The OpenVINO backend: compile, then infer through the async infer-request queue from the event loop."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import structlog

from backends.base import (
    BatchObserver,
    Capability,
    ModelMetadata,
    TensorRequest,
    TensorResponse,
)
from backends.cores import default_threads
from backends.errors import BackendInternalError, BackendTimeout, BackendUnavailable
from backends.openvino.options import OpenVINOOptions
from backends.openvino.ports import one_line, port_spec, read_tensor
from backends.openvino.slots import Slots
from backends.runtime.batcher import Arrays, DynamicBatcher, batcher_for
from backends.runtime.inline_runs import InlineRuns, call_bytes
from backends.runtime.lazy import require
from backends.runtime.tensor_requests import serve_tensor_request, zero_inputs
from backends.spec import DeploymentSpec

log = structlog.get_logger(__name__)


class OpenVINOBackend:
    """Serves one model with OpenVINO through its async infer-request queue; calls of a small, fast
    model run inline on the event loop's thread through an infer request of their own (`inline_runs`)."""

    capabilities = frozenset({Capability.TENSOR})

    def __init__(self, name: str, spec: DeploymentSpec, options: OpenVINOOptions) -> None:
        self.name = name
        self.spec = spec
        self.options = options
        self.device = spec.device or "CPU"
        self.batch_observer: BatchObserver | None = None
        self._compiled: Any = None
        self._queue: Any = None
        self._meta: ModelMetadata | None = None
        self._batcher: DynamicBatcher | None = None
        self._slots: Slots | None = None
        self._weights = "f32"  # how the file stores its float weights (see stored_weight_type)
        self._warm = False
        #: output name -> port index (reading a tensor by index skips a name lookup)
        self._output_index: dict[str, int] = {}
        self._all_outputs: tuple[str, ...] = ()
        self.inline = InlineRuns(0)  # set at load, once the devices are known
        self._inline_request: Any = None  # an infer request of its own, used on the loop's thread

    @property
    def ready(self) -> bool:
        return self._queue is not None and self._warm

    @property
    def queue_depth(self) -> int:
        return self._batcher.depth if self._batcher else 0

    @property
    def num_requests(self) -> int:
        """Infer requests in the queue (0 before `load()`)."""
        return len(self._queue) if self._queue is not None else 0

    def metadata(self) -> ModelMetadata:
        if self._meta is None:
            raise BackendUnavailable(f"deployment {self.name!r} is not loaded")
        return self._meta

    def _compile_config(self) -> dict[str, Any]:
        config: dict[str, Any] = {
            "PERFORMANCE_HINT": self.options.performance_hint,
            "INFERENCE_PRECISION_HINT": self.options.precision,
        }
        if self.options.cache_dir:
            config["CACHE_DIR"] = self.options.cache_dir
        if self.options.num_requests is not None:
            config["PERFORMANCE_HINT_NUM_REQUESTS"] = self.options.num_requests
        # unset on the CPU, OpenVINO uses every core; under `server.workers` one worker's share
        threads = self.options.num_threads
        if threads is None and self.device.upper() == "CPU":
            threads = default_threads()
        if threads is not None:
            config["INFERENCE_NUM_THREADS"] = threads
        return config

    def _compile(self) -> tuple[Any, Any]:
        ov = require("openvino", extra="openvino")
        core = ov.Core()
        path = str(self.spec.model)
        try:
            model = core.read_model(path)
        except Exception as exc:
            raise RuntimeError(f"cannot read OpenVINO model {path}: {one_line(exc)}") from None
        self._weights = stored_weight_type(model)
        try:
            compiled = core.compile_model(model, self.device, self._compile_config())
        except Exception as exc:
            raise RuntimeError(
                f"cannot compile {path} for OpenVINO device {self.device}: {one_line(exc)}"
            ) from None
        jobs = self.options.num_requests or 0  # 0 = OPTIMAL_NUMBER_OF_INFER_REQUESTS
        queue = ov.AsyncInferQueue(compiled, jobs)
        return compiled, queue

    async def load(self) -> None:
        """Read and compile the model off the event loop (compilation takes seconds on big models)."""
        compiled, queue = await asyncio.to_thread(self._compile)
        inputs = [port_spec(p) for p in compiled.inputs]
        outputs = [port_spec(p) for p in compiled.outputs]
        queue.set_callback(self._on_done)
        self._compiled, self._queue = compiled, queue
        self.inline = InlineRuns.from_options(
            self.options.inline_below_us, self.options.inline_alone_below_us, on_cpu=self._runs_on_cpu()
        )
        if self.inline.below_s > 0 or self.inline.alone_below_s > 0:
            self._inline_request = compiled.create_infer_request()
        self._output_index = {s.name: i for i, s in enumerate(outputs)}
        self._all_outputs = tuple(s.name for s in outputs)
        self._slots = Slots(len(queue))
        self._meta = ModelMetadata(
            name=self.name,
            platform="openvino_onnx" if str(self.spec.model).endswith(".onnx") else "openvino_ir",
            inputs=inputs,
            outputs=outputs,
            device=",".join(self._property("EXECUTION_DEVICES", [self.device])),
            extra=self._extra(),
        )
        log.info("openvino_loaded", deployment=self.name, **self._meta.extra)
        if self._weights == "f16" and self.options.precision == "f32":
            # `ov.save_model` compresses weights to f16 unless told not to; results then differ from the
            # f32 source model by ~1e-4, which looks like a runtime bug to whoever compares them
            log.warning(
                "openvino_f16_weights",
                deployment=self.name,
                hint="the IR stores f16 weights (ov.save_model's default compress_to_fp16=True); "
                "save it with compress_to_fp16=False for f32 results",
            )
        running = self._meta.extra["precision"]
        if running != self.options.precision:
            # OpenVINO takes a lower-precision hint the device cannot run (bf16 without AVX512-BF16
            # or AMX) and compiles f32 instead, silently; say so, the metadata has the truth
            log.warning(
                "openvino_precision_unavailable",
                deployment=self.name,
                requested=self.options.precision,
                running=running,
                device=self._meta.device,
            )
        if self.spec.batching is not None:
            # One batch per infer request: THROUGHPUT's streams run batches side by side.
            self._batcher = batcher_for(
                self.name,
                self.spec.batching,
                inputs + outputs,
                self._run_async,
                lambda: self.batch_observer,
                max_in_flight=len(queue),
                run_alone=self._run_alone,
            )

    def _runs_on_cpu(self) -> bool:
        """Whether every device the compiled model runs on is the CPU (inline runs are CPU-only: a GPU
        run waits for the device, and a new shape may compile kernels first)."""
        devices = self._property("EXECUTION_DEVICES", [self.device])
        return bool(devices) and all(str(d).upper().startswith("CPU") for d in devices)

    def _property(self, key: str, default: Any) -> Any:
        try:
            return self._compiled.get_property(key)
        except Exception:  # AUTO/HETERO do not expose every property of the device they chose
            return default

    def _extra(self) -> dict[str, Any]:
        precision = self._property("INFERENCE_PRECISION_HINT", None)
        return {
            "requested_device": self.device,
            "precision": precision.get_type_name() if precision is not None else self.options.precision,
            "performance_hint": str(self._property("PERFORMANCE_HINT", self.options.performance_hint)).split(
                "."
            )[-1],
            "num_requests": len(self._queue),
            "cache_dir": self.options.cache_dir,
            "model_file": os.path.basename(str(self.spec.model)),
            "stored_weights": self._weights,
        }

    async def warmup(self) -> None:
        """Run one request of zeros so the first caller does not pay for lazy initialisation."""
        await self._run_async(zero_inputs(self.metadata()), None)
        self._warm = True

    async def close(self) -> None:
        if self._batcher is not None:
            await self._batcher.close()
            self._batcher = None
        queue, self._queue = self._queue, None
        self._inline_request = None  # later calls take the queue path, which says not loaded
        self._warm = False
        if queue is not None:
            await asyncio.to_thread(queue.wait_all)  # let running requests finish before dropping them
        self._compiled = None

    async def infer(self, request: TensorRequest) -> TensorResponse:
        return await serve_tensor_request(request, self.metadata(), self._batcher, self._run_async)

    async def _acquire_idle(self) -> None:
        """Take a slot, then make sure OpenVINO's pool really has the idle request, without blocking."""
        assert self._slots is not None and self._queue is not None
        queue = self._queue
        await self._slots.acquire(queue.is_ready)
        spins = 0
        try:
            while not queue.is_ready():
                # The slot's previous request resolved on the loop, but OpenVINO returns a request
                # to its idle pool only after the callback returns: a window of microseconds.
                spins += 1
                await asyncio.sleep(0 if spins < 100 else 0.001)
        except BaseException:  # cancelled (deadline) before starting: the slot goes back
            self._slots.release()
            raise

    async def _run_alone(self, inputs: Arrays, outputs: tuple[str, ...] | None) -> Arrays:
        """The batcher's lone request (nothing queued, no company expected): it may run inline."""
        slots = self._slots
        return await self._run_async(inputs, outputs, alone=slots is not None and slots.free == slots.size)

    async def _run_async(
        self, inputs: Arrays, outputs: tuple[str, ...] | None, alone: bool = False
    ) -> Arrays:
        """Run one inference inline (small, fast calls) or on an idle infer request of the queue."""
        size = call_bytes(inputs)
        if self.inline.run_inline(size, available=self._inline_request is not None, alone=alone):
            started = time.perf_counter()
            result = self._infer_inline(inputs, outputs)
            self.inline.record(time.perf_counter() - started, size)
            return result
        try:
            async with asyncio.timeout(self.spec.timeout_s):
                if self._queue is None:
                    raise BackendUnavailable(f"deployment {self.name!r} is not loaded")
                await self._acquire_idle()
                loop = asyncio.get_running_loop()
                future: asyncio.Future[Arrays] = loop.create_future()
                names = outputs if outputs is not None else self._all_outputs
                indices = tuple(self._output_index[n] for n in names)
                feeds = {k: (v.astype(bytes) if v.dtype == object else v) for k, v in inputs.items()}
                try:
                    # Does not block: _acquire_idle saw an idle request and nothing ran since.
                    # share_inputs: OpenVINO reads the arrays in place instead of copying them into
                    # its own tensors; `feeds` rides in the userdata so they outlive the inference.
                    # a small call's latency informs the inline estimate
                    measured = size if self.inline.is_small(size) else None
                    self._queue.start_async(
                        feeds, (loop, future, names, indices, feeds, measured), share_inputs=True
                    )
                except Exception as exc:
                    self._slots.release()  # type: ignore[union-attr]
                    raise BackendInternalError(f"OpenVINO failed: {one_line(exc)}") from None
                # Not shielded: a caller that gives up cancels the future, and _resolve, which
                # still frees the slot, skips a future that is already done.
                return await future
        except TimeoutError:
            raise BackendTimeout(
                f"deployment {self.name!r}: no result within {self.spec.timeout_s}s"
            ) from None

    def _infer_inline(self, inputs: Arrays, outputs: tuple[str, ...] | None) -> Arrays:
        """One inference on the loop's own infer request, synchronously (OpenVINO releases the GIL)."""
        request = self._inline_request
        names = outputs if outputs is not None else self._all_outputs
        try:
            # no string inputs to convert here: `call_bytes` keeps calls holding strings off this path
            request.infer(inputs, share_inputs=True)
            # Copy: the request's output buffers are reused by the next inference.
            return {name: read_tensor(request.get_output_tensor(self._output_index[name])) for name in names}
        except Exception as exc:
            raise BackendInternalError(f"OpenVINO failed: {one_line(exc)}") from None

    def _on_done(self, request: Any, userdata: tuple[Any, ...]) -> None:
        """OpenVINO's completion callback, on one of its threads: copy outputs, wake the loop."""
        loop, future, names, indices, _feeds, measured = userdata
        result: Arrays | BaseException
        try:
            # Copy: the request's output buffers are reused by the next inference.
            result = {
                name: read_tensor(request.get_output_tensor(i))
                for name, i in zip(names, indices, strict=True)
            }
        except Exception as exc:
            result = BackendInternalError(f"OpenVINO failed reading outputs: {one_line(exc)}")
        # the runtime's own figure for this inference (ms), free of any wait for the GIL
        failed = isinstance(result, BaseException)
        latency_s = request.latency / 1e3 if measured is not None and not failed else None
        loop.call_soon_threadsafe(self._resolve, future, result, latency_s, measured)

    def _resolve(
        self,
        future: asyncio.Future,
        result: Arrays | BaseException,
        latency_s: float | None = None,
        input_bytes: int | None = None,
    ) -> None:
        if latency_s is not None and input_bytes is not None:  # a measured call: both are set
            self.inline.record(latency_s, input_bytes)
        if not future.done():  # the caller may have timed out or been cancelled
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        if self._slots is not None:
            self._slots.release()


def stored_weight_type(model: Any) -> str:
    """How the model's float weights are stored: "f16" when any float constant is f16 (a compressed IR,
    decompressed at compile time), likewise "bf16", else "f32"."""
    kinds = {
        op.get_element_type().get_type_name()
        for op in model.get_ops()
        if op.get_type_name() == "Constant" and op.get_element_type().is_real()
    }
    return next((kind for kind in ("f16", "bf16") if kind in kinds), "f32")
