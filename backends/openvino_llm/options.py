"""`options:` of an `openvino_llm` deployment, and its `device:` values."""

from __future__ import annotations

from typing import Any, Literal

from backends.spec import SpecBase, decode_options

#: devices OpenVINO GenAI's continuous-batching pipeline runs on
DEVICES = ("CPU", "GPU", "NPU", "AUTO")


class OpenVINOLLMOptions(SpecBase):
    """Settings of OpenVINO GenAI's continuous-batching pipeline (its SchedulerConfig and plugin
    properties)."""

    #: KV cache size in GB (SchedulerConfig.cache_size); ignored when `num_kv_blocks` is set
    cache_size_gb: int = 1
    #: KV cache size in blocks instead of GB
    num_kv_blocks: int | None = None
    #: sequences in the running batch at most; the fair queue dispatches only while one is free
    max_num_seqs: int = 32
    #: tokens (prompt chunks plus one per decoding sequence) in one pipeline step at most
    max_num_batched_tokens: int = 2048
    #: reuse the KV blocks of a prompt prefix already computed (shared system prompts, chat turns)
    enable_prefix_caching: bool = True
    #: split long prompts into chunks that share a step with decoding sequences (vLLM's chunked
    #: prefill); off: a prompt is computed whole in its own step
    dynamic_split_fuse: bool = True
    #: CPU threads of the inference (INFERENCE_NUM_THREADS); None: OpenVINO's choice (all cores)
    threads: int | None = None
    #: the precision OpenVINO computes in (INFERENCE_PRECISION_HINT). f32 by default: CPUs with
    #: bf16 support otherwise compute in bf16, whose answers differ from the exported weights'
    precision: Literal["f32", "bf16", "f16", "auto"] = "f32"
    #: KV cache precision (KV_CACHE_PRECISION). f32 by default, for the same reason: the CPU's own
    #: default (u8) quarters the cache's memory but flips near-tied greedy tokens (measured on the
    #: tests' tiny Llama: 11 of 24 tokens agreed with Hugging Face on u8, all 24 on f32); auto: the
    #: device's default
    kv_cache_precision: Literal["auto", "f32", "f16", "bf16", "u8"] = "f32"

    def __post_init__(self) -> None:
        if self.cache_size_gb < 1:
            raise ValueError("cache_size_gb must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")

    def properties(self) -> dict[str, Any]:
        """The plugin properties handed to the pipeline."""
        props: dict[str, Any] = {}
        if self.precision != "auto":
            props["INFERENCE_PRECISION_HINT"] = self.precision
        if self.kv_cache_precision != "auto":
            props["KV_CACHE_PRECISION"] = self.kv_cache_precision
        if self.threads is not None:
            props["INFERENCE_NUM_THREADS"] = self.threads
        return props


def parse_options(raw: dict[str, Any]) -> OpenVINOLLMOptions:
    """Raises ValueError naming the option (`options.max_num_seqs`)."""
    return decode_options(raw, OpenVINOLLMOptions)


def device_problem(device: str) -> str | None:
    """Why `device` is not an `openvino_llm` device, or None."""
    if device.upper() in DEVICES:
        return None
    return f"unknown openvino_llm device {device!r}: use {', '.join(DEVICES)}"
