"""ONNX Runtime adapter: one `.onnx` file, execution providers from the config.

onnxruntime-gpu lists CUDA and TensorRT providers even on machines without a GPU and, when asked
for them, prints a multi-line load error and falls back to CPU. So the adapter asks for them only
where the CUDA driver sees a GPU, compares what it asked for with what the session really got
(`get_providers()`) and reports the truth in its metadata and one warning log line.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import structlog

from backends.base import (
    BatchObserver,
    Capability,
    ModelMetadata,
    TensorRequest,
    TensorResponse,
    TensorSpec,
)
from backends.cores import cores_per_worker, default_threads
from backends.errors import BackendInternalError, BackendUnavailable, InvalidInput
from backends.runtime.batcher import Arrays, DynamicBatcher, batcher_for
from backends.runtime.cuda_devices import cuda_device_count
from backends.runtime.inline_runs import InlineRuns, call_bytes
from backends.runtime.lazy import require
from backends.runtime.tensor_requests import serve_tensor_request, zero_inputs
from backends.spec import DeploymentSpec, SpecBase, decode_options

log = structlog.get_logger(__name__)

#: ONNX tensor type string -> Open Inference Protocol datatype
ONNX_TO_V2 = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


class OnnxOptions(SpecBase):
    #: threads inside one run (0 = ONNX Runtime's default, a thread per core; under `server.workers:
    #: N`, one worker's share of the cores, `backends/cores.py`)
    intra_op_threads: int = 0
    #: runs that may execute at the same time (ONNX Runtime sessions are thread-safe); with
    #: batching, also the number of batches in flight. 0 = as many as the cores hold without
    #: oversubscribing them (`parallel_runs`): on CPU one per `intra_op_threads` of this worker's
    #: cores, so 1 with the default threads, which already use them all; on an accelerator provider 2,
    #: so one run's copies overlap another's kernels
    max_parallel_runs: int = 0
    #: ORT_ENABLE_ALL unless disabled
    graph_optimization: bool = True
    #: let ONNX Runtime's intra-op threads busy-wait for the next parallel section. Off by default:
    #: between a gateway's requests they would spin on cores the event loop needs (digits, 64 rows
    #: per request: 1.63 -> 0.81 ms of server CPU per request with spinning off, +40% requests/s)
    allow_spinning: bool = False
    #: on CPU, run a call with small inputs on the event loop's thread, skipping the hand-off to a
    #: worker, while recent runs took less than this many microseconds (`backends/runtime/inline_runs.py`);
    #: 0 = never by this rule (`inline_alone_below_us` may still run a lone call inline; both 0:
    #: always a worker thread). Inline runs come on top of `max_parallel_runs`.
    inline_below_us: int = 200
    #: on CPU with batching, also run a lone call inline (nothing else of this deployment running
    #: or queued, no batch forming) while the median of the recent runs is under this many
    #: microseconds and none took over twice that: it saves the hand-off's wake-ups on a lone
    #: request, and holds the loop (every deployment's requests) for as long. 0 = never.
    inline_alone_below_us: int = 5000

    def __post_init__(self) -> None:
        if self.intra_op_threads < 0:
            raise ValueError("intra_op_threads must be >= 0 (0: ONNX Runtime's default)")
        if self.max_parallel_runs < 0:
            raise ValueError("max_parallel_runs must be >= 0 (0: one per intra_op_threads cores)")


#: runs in flight on an accelerator provider (GPU) when `max_parallel_runs` is 0
GPU_PARALLEL_RUNS = 2


def device_of(provider: str) -> str:
    """The device an execution provider runs on, as metadata, logs and metrics name it: "cpu",
    "cuda" (CUDA and TensorRT), else the provider's own name ("rocm", "dml", "openvino", ...)."""
    if provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider"):
        return "cuda"
    return provider.removesuffix("ExecutionProvider").lower()


#: providers that need an NVIDIA GPU and its CUDA driver
CUDA_PROVIDERS = frozenset({"CUDAExecutionProvider", "TensorrtExecutionProvider", "NvTensorRTRTXExecutionProvider"})


def providers_to_ask(wanted: list[str], cuda_devices: int) -> list[str]:
    """The configured providers worth asking ONNX Runtime for: without a CUDA device the CUDA ones
    can only fail (loudly, on stderr), so they are left out; the CPU closes the list."""
    asked = [p for p in wanted if cuda_devices > 0 or p not in CUDA_PROVIDERS]
    return asked or ["CPUExecutionProvider"]


def parallel_runs(options: OnnxOptions, on_cpu: bool, cores: int) -> int:
    """Runs (batches) a deployment lets execute at once: the configured number, else what `cores`
    hold without oversubscribing them.

    Two runs that each use every core only take turns on them, in smaller batches that cost more
    CPU a row: `bench/bench_parallel_runs.py` (the issue #14 MLP, 2 cores, c=32) measured two runs
    at 0.86x the requests/s and 1.27x the server CPU a request of one.
    """
    if options.max_parallel_runs:
        return options.max_parallel_runs
    if not on_cpu:
        return GPU_PARALLEL_RUNS
    return max(1, cores // options.intra_op_threads) if options.intra_op_threads else 1


def _spec_of(node: Any) -> TensorSpec:
    datatype = ONNX_TO_V2.get(node.type)
    if datatype is None:
        raise ValueError(f"tensor {node.name!r} has type {node.type}, which the gateway cannot serve")
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in node.shape)
    return TensorSpec(name=node.name, datatype=datatype, shape=shape)


class OnnxRuntimeBackend:
    """Serves one ONNX model with ONNX Runtime: calls of a small, fast model on the event loop's thread,
    the rest on worker threads (`inline_runs`)."""

    capabilities = frozenset({Capability.TENSOR})

    def __init__(self, name: str, spec: DeploymentSpec, options: OnnxOptions) -> None:
        self.name = name
        self.spec = spec
        self.options = options
        self.batch_observer: BatchObserver | None = None
        self._worker_runs = 0  # calls on the executor now (a call is alone only when there are none)
        self._session: Any = None
        self._meta: ModelMetadata | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._batcher: DynamicBatcher | None = None
        self._warm = False
        self.inline = InlineRuns(0)  # set at load, once the device is known
        self.runs_in_flight = 0  # set at load (`parallel_runs`)

    @property
    def ready(self) -> bool:
        return self._session is not None and self._warm

    @property
    def queue_depth(self) -> int:
        return self._batcher.depth if self._batcher else 0

    def metadata(self) -> ModelMetadata:
        if self._meta is None:
            raise BackendUnavailable(f"deployment {self.name!r} is not loaded")
        return self._meta

    async def load(self) -> None:
        ort = require("onnxruntime", extra="onnx")
        # warnings of ONNX Runtime's process-wide logger (provider set-up) are reported by us, once,
        # as a log line; its errors still reach stderr
        ort.set_default_logger_severity(3)
        wanted = list(self.spec.providers or ["CPUExecutionProvider"])
        asked = providers_to_ask(wanted, cuda_device_count() if CUDA_PROVIDERS.intersection(wanted) else 0)
        opts = ort.SessionOptions()
        opts.log_severity_level = 3  # the provider fallback is reported by us, once, as a log line
        opts.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if self.options.allow_spinning else "0"
        )
        # unset, ONNX Runtime starts a thread per core; under `server.workers` one worker's share
        threads = self.options.intra_op_threads or default_threads()
        if threads:
            opts.intra_op_num_threads = threads
        if not self.options.graph_optimization:
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        loop = asyncio.get_running_loop()
        try:
            self._session = await loop.run_in_executor(
                None, lambda: ort.InferenceSession(self.spec.model, sess_options=opts, providers=asked)
            )
        except Exception as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RuntimeError(f"cannot load ONNX model {self.spec.model}: {first_line}") from None
        got = self._session.get_providers()
        missing = [p for p in wanted if p not in got]
        if missing:
            skipped = [p for p in wanted if p not in asked]
            why = "no CUDA device visible (no NVIDIA driver or GPU)" if skipped else "ONNX Runtime could not create them"
            log.warning(
                "onnx_providers_unavailable",
                deployment=self.name,
                requested=wanted,
                got=got,
                missing=missing,
                reason=why,
            )
        inputs = [_spec_of(n) for n in self._session.get_inputs()]
        outputs = [_spec_of(n) for n in self._session.get_outputs()]
        # runs go to the provider first in line: it decides the device reported, how many runs
        # go at once and whether a small one may run on the loop's thread
        device = device_of(got[0])
        on_cpu = device == "cpu"
        self.runs_in_flight = parallel_runs(self.options, on_cpu, cores_per_worker())
        self._executor = ThreadPoolExecutor(self.runs_in_flight, thread_name_prefix=f"ort-{self.name}")
        self.inline = InlineRuns.from_options(
            self.options.inline_below_us, self.options.inline_alone_below_us, on_cpu=on_cpu
        )
        self._meta = ModelMetadata(
            name=self.name,
            platform="onnxruntime_onnx",
            inputs=inputs,
            outputs=outputs,
            device=device,
            extra={"providers": got, "model_file": os.path.basename(self.spec.model or "")},
        )
        self._batcher = batcher_for(
            self.name,
            self.spec.batching,
            inputs + outputs,
            self._run_async,
            lambda: self.batch_observer,
            max_in_flight=self.runs_in_flight,
            run_alone=self._run_alone,
        )

    async def warmup(self) -> None:
        """Run one request of zeros so the first caller does not pay for lazy initialisation."""
        await self._run_async(zero_inputs(self.metadata()), None)
        self._warm = True

    async def close(self) -> None:
        if self._batcher is not None:
            await self._batcher.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        self._session = None
        self._warm = False

    async def infer(self, request: TensorRequest) -> TensorResponse:
        return await serve_tensor_request(request, self.metadata(), self._batcher, self._run_async)

    async def _run_alone(self, inputs: Arrays, outputs: tuple[str, ...] | None) -> Arrays:
        """The batcher's lone request (nothing queued, no company expected): it may run inline.

        Only the batcher can tell a lone call: without batching, calls that wait behind an inline
        run on the loop would each find nothing running and all run inline, one after another."""
        return await self._run_async(inputs, outputs, alone=self._worker_runs == 0)

    async def _run_async(
        self, inputs: Arrays, outputs: tuple[str, ...] | None, alone: bool = False
    ) -> Arrays:
        if self._session is None or self._executor is None:
            raise BackendUnavailable(f"deployment {self.name!r} is not loaded")
        size = call_bytes(inputs)
        if self.inline.run_inline(size, alone=alone):
            result, seconds = self._run_timed(inputs, outputs)
            self.inline.record(seconds, size)
            return result
        loop = asyncio.get_running_loop()
        self._worker_runs += 1
        try:
            result, seconds = await loop.run_in_executor(self._executor, self._run_timed, inputs, outputs)
        finally:
            self._worker_runs -= 1
        if self.inline.is_small(size):
            self.inline.record(seconds, size)
        return result

    def _run_timed(self, inputs: Arrays, outputs: tuple[str, ...] | None) -> tuple[Arrays, float]:
        started = time.perf_counter()
        result = self._run_sync(inputs, outputs)
        return result, time.perf_counter() - started

    def _run_sync(self, inputs: Arrays, outputs: tuple[str, ...] | None) -> Arrays:
        names = list(outputs) if outputs is not None else [o.name for o in self._session.get_outputs()]
        feeds = {k: (v.astype(str) if v.dtype == object else v) for k, v in inputs.items()}
        try:
            values = self._session.run(names, feeds)
        except Exception as exc:
            # ORT's messages describe graph internals; keep the first line, drop paths and traces.
            text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            if "INVALID_ARGUMENT" in text or "Invalid" in text:
                raise InvalidInput(f"the model rejected the input: {text}") from None
            raise BackendInternalError(f"ONNX Runtime failed: {text}") from None
        return {
            n: (np.asarray(v, dtype=object) if isinstance(v, list) else v)
            for n, v in zip(names, values, strict=True)
        }


def create(name: str, spec: DeploymentSpec) -> OnnxRuntimeBackend:
    """Validate a deployment for ONNX Runtime; nothing heavy happens until `load()`."""
    if not spec.model:
        raise ValueError("model: an .onnx file is required for backend onnxruntime")
    if not os.path.isfile(spec.model):
        raise ValueError(f"model: {spec.model} is not a file")
    options = decode_options(spec.options, OnnxOptions)
    if options.inline_below_us < 0:
        raise ValueError(
            f"options.inline_below_us must be >= 0 (0: this rule never runs a call inline), got {options.inline_below_us}"
        )
    if options.inline_alone_below_us < 0:
        raise ValueError(
            "options.inline_alone_below_us must be >= 0 (0: a lone call never runs inline), "
            f"got {options.inline_alone_below_us}"
        )
    return OnnxRuntimeBackend(name, spec, options)
