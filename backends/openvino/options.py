"""`options:` of an openvino deployment."""

from __future__ import annotations

import re
from typing import Literal

from backends.spec import SpecBase


class OpenVINOOptions(SpecBase):
    """`options:` of an openvino deployment."""

    #: LATENCY (one request at a time, all cores) or THROUGHPUT (several streams in parallel)
    performance_hint: Literal["LATENCY", "THROUGHPUT"] = "LATENCY"
    #: compiled-model cache folder: a restart imports the compiled blob instead of compiling
    cache_dir: str | None = None
    #: inference precision; lower than f32 is an explicit choice (results change)
    precision: Literal["f32", "bf16", "f16"] = "f32"
    #: infer requests in the queue; None = the compiled model's optimal number
    num_requests: int | None = None
    #: threads OpenVINO may use (INFERENCE_NUM_THREADS); None = its default (every core; on `device:
    #: CPU` under `server.workers: N`, one worker's share, `backends/cores.py`). OpenVINO's threads
    #: busy-wait after each inference, which on a small model costs more CPU than the model itself
    #: (digits: ~0.15 ms per request): 1 trades that spin for less parallelism inside one request.
    num_threads: int | None = None
    #: on CPU, run a call with small inputs on the event loop's thread through an infer request of its
    #: own, skipping the queue's hand-off to OpenVINO's threads and back, while recent runs took less
    #: than this many microseconds (`backends/runtime/inline_runs.py`); 0 = never by this rule (with
    #: `inline_alone_below_us` also 0: always the queue)
    inline_below_us: int = 200
    #: on CPU with batching, also run a lone call inline (nothing else of this deployment running
    #: or queued, no batch forming) while the median of the recent runs is under this many
    #: microseconds and none took over twice that: it saves the queue's hand-offs on a lone
    #: request, and holds the loop (every deployment's requests) for as long. 0 = never.
    inline_alone_below_us: int = 5000

    def __post_init__(self) -> None:
        if self.inline_below_us < 0:
            raise ValueError("inline_below_us must be >= 0 (0: this rule never runs a call inline)")
        if self.inline_alone_below_us < 0:
            raise ValueError("inline_alone_below_us must be >= 0 (0: a lone call never runs inline)")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError("num_threads must be >= 1")


#: one OpenVINO device: CPU, GPU (or GPU.N, one of several), NPU
_ONE_DEVICE = re.compile(r"CPU|GPU(?:\.\d+)?|NPU")
#: `device:` of an openvino deployment
DEVICES = "CPU, GPU, GPU.N, NPU, AUTO, or AUTO:/HETERO:/MULTI: with a comma-separated list of those (HETERO:GPU,CPU)"


def device_problem(device: str) -> str | None:
    """Why `device` is not an OpenVINO device (naming the valid ones), or None when it is.

    OpenVINO's names are upper case (`cpu` fails only when the model is compiled, at load); the
    virtual devices take a priority list of real ones.
    """
    if device == "AUTO" or _ONE_DEVICE.fullmatch(device):
        return None
    virtual, sep, members = device.partition(":")
    if sep and virtual in ("AUTO", "HETERO", "MULTI") and members:
        # AUTO also takes exclusions (`AUTO:-CPU`)
        names = [m.strip().removeprefix("-") if virtual == "AUTO" else m.strip() for m in members.split(",")]
        if all(_ONE_DEVICE.fullmatch(n) for n in names):
            return None
    return f"unknown OpenVINO device {device!r}: use {DEVICES}"
