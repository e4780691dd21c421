"""The `options:` of a `torch_llm` deployment, decoded into a Struct so errors name the option."""

from __future__ import annotations

import re
from typing import Any, Literal

from backends.spec import SpecBase
from backends.spec import decode_options as decode_spec_options
from backends.tool_parsers import PARSERS


class LLMOptions(SpecBase):
    """Engine knobs. Every field has a default; unknown keys are errors.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_bytes: size of the KV pool on CPU (bytes).
        gpu_memory_utilization: fraction of the GPU's total memory the process may use (weights + KV).
        num_kv_blocks: fixed number of KV blocks (overrides both budgets; mostly for tests).
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: token budget of one step (chunked prefill splits longer prompts).
        max_prefill_tokens_with_decodes: most prompt tokens in a step that also runs decodes, so a
            long prompt's chunks do not stall running streams (inter-token latency). None: 512
            (bench/bench_llm_vllm.py, 2-core CPU, 16 in flight: with the final CPU kernel 256 gave
            371 tok/s, ITL p50 24 / p99 111 ms and 512 gave 402 tok/s, 21 / 183 ms: more throughput
            for a higher p99; on CUDA a 128-token chunk would leave prefill memory-bound); set it to
            `max_num_batched_tokens` for no cap.
        max_model_len: longest sequence (prompt + output); default: the model's max positions.
        dtype: "auto" (from config.json), "float32", "bfloat16" or "float16".
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        prefix_cache_scope: "tenant" isolates cached prefixes per tenant, "global" shares them
            (then an answer's `usage.prompt_tokens_details.cached_tokens` tells a tenant whether
            another one sent the same prompt prefix).
        num_threads: torch intra-op threads on CPU (None: torch's default, every core; under
            `server.workers: N`, one worker's share, `backends/cores.py`).
        seed: seed of the generator used by requests that give no seed.
        attention_backend: "auto" (Triton paged-decode kernel on CUDA, the C++ paged-decode kernel
            on CPU), "torch" (gather + SDPA everywhere), "triton" (the Triton kernel; on CPU only
            under TRITON_INTERPRET=1) or "cpu_kernel". A kernel that fails to build or to match
            gather + SDPA falls back to "torch".
        linear_backend: "auto" (on CPU: fleetgate's blocked kernel for float32, oneDNN with
            weights packed at load for bfloat16; torch's `F.linear` elsewhere), "blocked" (see
            `blocked_linear`), "onednn" (see `packed_linear`) or "torch".
        fused_ops: "auto" (on CPU, RMSNorm with the residual add before it, rotary and
            SiLU-and-multiply as fused C++ kernels built at first use; see `fused_cpu`) or "torch"
            (torch's ops). Kernels that fail to build or to match the torch ops fall back to them.
        cuda_graphs: "auto" (on CUDA with the Triton attention kernel and no LoRA layers, decode
            steps replay CUDA graphs captured at load, one per batch size up to
            min(max_num_seqs, 128); see `cuda_graphs`) or "off" (every step launched eagerly).
        enable_lora: give the model LoRA layers even when the deployment declares no `adapters`
            (so adapters can be loaded at run time through the admin API). On whenever `adapters`
            is set.
        max_loras: adapters resident on the device at once (the others wait in host memory and
            are paged in, least recently used out); also the most distinct adapters in one step.
        max_lora_rank: the largest rank an adapter may have (the device slots are this wide).
        quantization: "int8" stores every decoder projection as int8 weights with a float scale
            per output channel (weight-only; the LM head and embeddings stay in `dtype`).
        grammar_cache_size: compiled output constraints (JSON schemas, regexes, grammars) kept,
            least recently used out; a cached one adds well under a millisecond to a request.
        grammar_compile_timeout_s: longest a new constraint may take to compile (on a worker
            thread) before its request is refused with a 400 "compile timed out".
        tool_parser: how tool calls are read from the output under `tool_choice: "auto"` (vLLM's
            names: "hermes", "llama3_json", "mistral"); None: the one the chat template's tool
            format asks for, where it is recognised (see docs/tool_calls.md).
    """

    block_size: int = 16
    kv_cache_bytes: int = 256 * 1024 * 1024
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_tokens_with_decodes: int | None = None
    max_model_len: int | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    enable_prefix_caching: bool = True
    prefix_cache_scope: Literal["tenant", "global"] = "tenant"
    num_threads: int | None = None
    seed: int = 0
    attention_backend: Literal["auto", "torch", "triton", "cpu_kernel"] = "auto"
    linear_backend: Literal["auto", "torch", "onednn", "blocked"] = "auto"
    fused_ops: Literal["auto", "torch"] = "auto"
    cuda_graphs: Literal["auto", "off"] = "auto"
    enable_lora: bool = False
    max_loras: int = 8
    max_lora_rank: int = 16
    quantization: Literal["int8"] | None = None
    grammar_cache_size: int = 128
    grammar_compile_timeout_s: float = 10.0
    tool_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_parser is not None and self.tool_parser not in PARSERS:
            raise ValueError(f"options.tool_parser {self.tool_parser!r} is not one of {', '.join(sorted(PARSERS))}")
        checks = [
            ("block_size", self.block_size >= 1, "must be >= 1"),
            ("kv_cache_bytes", self.kv_cache_bytes >= 1, "must be >= 1"),
            ("gpu_memory_utilization", 0.0 < self.gpu_memory_utilization <= 1.0, "must be in (0, 1]"),
            ("num_kv_blocks", self.num_kv_blocks is None or self.num_kv_blocks >= 1, "must be >= 1"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= 1, "must be >= 1"),
            (
                "max_prefill_tokens_with_decodes",
                self.max_prefill_tokens_with_decodes is None or self.max_prefill_tokens_with_decodes >= 1,
                "must be >= 1",
            ),
            ("max_model_len", self.max_model_len is None or self.max_model_len >= 2, "must be >= 2"),
            ("num_threads", self.num_threads is None or self.num_threads >= 1, "must be >= 1"),
            ("max_loras", 1 <= self.max_loras <= 1024, "must be in 1..1024"),
            ("max_lora_rank", 1 <= self.max_lora_rank <= 1024, "must be in 1..1024"),
            ("grammar_cache_size", self.grammar_cache_size >= 1, "must be >= 1"),
            ("grammar_compile_timeout_s", self.grammar_compile_timeout_s > 0, "must be > 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"options.{name} {why}")


#: `device:` of a torch_llm deployment (auto: CUDA when torch sees a GPU, else the CPU)
DEVICES = "cpu, cuda, cuda:N or auto"


def device_problem(device: str) -> str | None:
    """Why `device` is not a torch_llm device (naming the valid ones), or None when it is."""
    if device in ("cpu", "cuda", "auto") or re.fullmatch(r"cuda:\d+", device):
        return None
    return f"unknown torch_llm device {device!r}: use {DEVICES}"


def decode_options(raw: dict[str, Any]) -> LLMOptions:
    """Decode a deployment's `options` mapping (see `backends.spec.decode_options`).

    Raises:
        ValueError: with a message naming the offending option (`... at `options.block_size``).
    """
    return decode_spec_options(raw, LLMOptions)
