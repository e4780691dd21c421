"""Assemble an engine from a model folder and options: load, size the KV pool, wire the parts."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from backends.cores import default_threads
from backends.torch_llm.engine import EngineConfig, LLMEngine
from backends.torch_llm.kernels.packed_linear import (
    PackedLinear,
    fuse_projections,
    onednn_available,
    pack_linears,
)
from backends.torch_llm.lora.pool import LoRAPool
from backends.torch_llm.lora.weights import load_adapter
from backends.torch_llm.model.config import ModelConfig
from backends.torch_llm.model.loader import load_model, resolve_dtype
from backends.torch_llm.options import LLMOptions
from backends.torch_llm.runner import ModelRunner, kv_bytes_per_block
from backends.torch_llm.scheduler import WaitingQueue
from backends.torch_llm.tokenizer import TextTokenizer


@dataclass
class EngineParts:
    engine: LLMEngine
    tokenizer: TextTokenizer | None
    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    num_blocks: int
    #: the engine's adapters (None: LoRA is off for this deployment)
    lora: LoRAPool | None = None
    #: adapters declared at start that could not be loaded: name -> why
    adapter_errors: dict[str, str] = field(default_factory=dict)


def resolve_device(name: str | None) -> torch.device:
    """`None`/"auto": CUDA when present, else CPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not supported (cpu, cuda, cuda:N, auto)")
    return device


def num_kv_blocks(options: LLMOptions, per_block: int, device: torch.device) -> int:
    """Blocks that fit the budget: bytes on CPU, a fraction of total GPU memory on CUDA."""
    if options.num_kv_blocks is not None:
        return options.num_kv_blocks
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # What torch's caching allocator holds but no tensor uses (freed by an earlier model or step)
        # is free to this process too, though the driver counts it as taken.
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        # Keep (1 - utilization) of the card plus a margin for activations free.
        budget = free - total * (1.0 - options.gpu_memory_utilization) - 2 * 1024**3
    else:
        budget = options.kv_cache_bytes
    blocks = int(budget // per_block)
    if blocks < 1:
        where = (
            "raise gpu_memory_utilization or free the GPU"
            if device.type == "cuda"
            else "raise kv_cache_bytes"
        )
        raise ValueError(f"the KV cache budget does not hold a single block; {where}")
    return blocks


def _linear_maker(
    options: LLMOptions, device: torch.device, dtype: torch.dtype
) -> Callable[[nn.Linear], nn.Module] | None:
    """What replaces the plain linears (`linear_backend`), or None to keep `F.linear`: on CPU,
    "auto" is the blocked kernel for float32 where it builds, else oneDNN's packed linears where
    oneDNN serves the dtype. Naming a backend that cannot serve here is an error, not a fallback."""
    choice = options.linear_backend
    if choice == "torch" or device.type != "cpu":
        return None
    if choice in ("auto", "blocked") and dtype == torch.float32:
        from backends.torch_llm.kernels.blocked_linear import BlockedLinear, kernel_or_none

        kernel = kernel_or_none()
        if kernel is not None:
            return lambda linear: BlockedLinear(linear, kernel)
        if choice == "blocked":
            raise ValueError("options.linear_backend: the blocked kernel does not build here (see the log)")
    elif choice == "blocked":
        raise ValueError(f"options.linear_backend: the blocked kernel is for float32, not {dtype}")
    if onednn_available(dtype):
        return PackedLinear
    if choice == "onednn":
        raise ValueError(f"options.linear_backend: oneDNN is not available here for {dtype}")
    return None


def prefill_cap_with_decodes(options: LLMOptions, device: torch.device) -> int:
    """`max_prefill_tokens_with_decodes`, or its default (512 on every device; see LLMOptions)."""
    if options.max_prefill_tokens_with_decodes is not None:
        return options.max_prefill_tokens_with_decodes
    return 512


def build_engine(
    folder: pathlib.Path,
    options: LLMOptions,
    *,
    device: str | None = None,
    deployment: str = "llm",
    waiting: WaitingQueue | None = None,
    clock: Callable[[], float] = time.monotonic,
    with_tokenizer: bool = True,
    adapters: Mapping[str, str | pathlib.Path] | None = None,
) -> EngineParts:
    """Load the model in `folder` and build an engine for it (blocking; seconds for large models).

    `adapters` (name -> PEFT folder) are loaded into the engine's LoRA pool; one that fails to load
    is left out and reported in `EngineParts.adapter_errors` (the base and the other adapters serve).
    """
    dev = resolve_device(device)
    cfg = ModelConfig.from_folder(folder)
    dtype = resolve_dtype(cfg, options.dtype, dev)
    # unset, torch uses every core; under `server.workers` one worker's share (backends/cores.py)
    threads = options.num_threads or default_threads()
    if threads and dev.type == "cpu":
        torch.set_num_threads(threads)
    model = load_model(folder, dev, dtype)
    if options.quantization is not None:
        from backends.torch_llm.model.quantization import check_quantization, quantize_linears

        check_quantization(options.quantization, dev.type)
        quantize_linears(model)
    wants_lora = bool(adapters) or options.enable_lora
    make_linear = _linear_maker(options, dev, dtype)
    if make_linear is not None:
        if not wants_lora:  # LoRA wraps q, k, v, gate and up one by one
            fuse_projections(model)
        pack_linears(model, make=make_linear)
    if options.fused_ops == "auto" and dev.type == "cpu":
        from backends.torch_llm.kernels.fused_cpu import cpu_kernels_or_none

        model.use_fused_ops(cpu_kernels_or_none(dtype))
    lora = None
    if wants_lora:
        lora = LoRAPool(model, max_loras=options.max_loras, max_rank=options.max_lora_rank)
    adapter_errors: dict[str, str] = {}
    for name, path in (adapters or {}).items():
        try:
            lora.add(load_adapter(name, path, cfg, max_rank=options.max_lora_rank, dtype=dtype))  # type: ignore[union-attr]
        except (OSError, ValueError) as exc:
            adapter_errors[name] = str(exc)
    tokenizer = TextTokenizer(folder) if with_tokenizer else None
    blocks = num_kv_blocks(options, kv_bytes_per_block(model, options.block_size, dtype), dev)
    max_len = options.max_model_len or cfg.max_position_embeddings
    if cfg.sliding_window:  # attention here is full; stay inside the window where both agree
        max_len = min(max_len, cfg.sliding_window)
    # One sequence must always fit the pool, or it could never finish.
    max_len = min(max_len, blocks * options.block_size)
    eos = set(cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    graphs = options.cuda_graphs == "auto" and dev.type == "cuda" and lora is None
    runner = ModelRunner(
        model,
        num_blocks=blocks,
        block_size=options.block_size,
        attention=options.attention_backend,
        lora=lora,
        spare_block=graphs,  # the scratch slot of the graphs' padding rows
    )
    if graphs:
        runner.use_decode_graphs(options.max_num_seqs, max_len)
    engine = LLMEngine.create(
        runner,
        tokenizer,
        EngineConfig(
            max_model_len=max_len,
            eos_token_ids=frozenset(eos),
            seed=options.seed,
            deployment=deployment,
            vocab_size=cfg.vocab_size,
        ),
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_prefill_tokens_with_decodes=prefill_cap_with_decodes(options, dev),
        enable_prefix_caching=options.enable_prefix_caching,
        waiting=waiting,
        clock=clock,
    )
    return EngineParts(engine, tokenizer, cfg, dev, dtype, max_len, blocks, lora, adapter_errors)
