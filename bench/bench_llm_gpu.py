"""Decode throughput of the torch_llm engine on one CUDA GPU, Llama-3-8B-shaped, random weights, bf16.

The model is built directly on the GPU (allocated from the meta device, weights drawn there), so no
16 GB of host weights are written or read. For each batch size (default 1, 8, 32, 128, 256) the engine gets
that many requests with `--prompt-len` random prompt tokens, prefills them, runs `--warmup` decode
steps, then times `--steps` decode steps (every running sequence gets one token per step; greedy,
ignore_eos). With `--cuda-graphs both` (the default) the same running batch is timed in turns,
launched eagerly and replayed from the captured decode graphs (`cuda_graphs.py`; a batch past the
largest graph is timed eagerly only), `--rounds` times each, the order alternating by round
(contexts grow by `--steps` a turn). Reported per batch and mode: output
tokens/s, step time, and memory-bandwidth utilisation = (weight bytes + KV bytes read per step) x
steps/s / measured device copy bandwidth (read + write of a 1 GiB `copy_`, best of 10), with medians
and the graphs/eager ratio in `summary`. Writes bench/results/llm_gpu.json and a PNG. Without a CUDA
device it says so and exits with status 0, measuring nothing and writing nothing.

    .venv/bin/python -m bench.bench_llm_gpu --batches 1,8,32,128,256 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time
from typing import Any

import structlog

from backends.base import SamplingParams
from backends.torch_llm.model.config import ModelConfig
from backends.torch_llm.model.costs import decode_bytes_per_step, kv_bytes_per_token, parameter_count

ROOT = pathlib.Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
log = structlog.get_logger("bench_llm_gpu")

LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def model_config(**overrides: Any) -> ModelConfig:
    """Llama-3-8B's architecture (as in its config.json), with `overrides` (e.g. a tiny shape for tests)."""
    return ModelConfig.from_dict({**LLAMA3_8B, **overrides})


def build_random_model(cfg: ModelConfig, device: Any, dtype: Any, seed: int = 0) -> Any:
    """The model with random weights drawn on `device` (norms 1, matrices N(0, 0.02))."""
    import torch

    from backends.torch_llm.model.loader import build_model

    model = build_model(cfg, torch.device(device), dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model


def build_engine_for(model: Any, *, max_num_seqs: int, options: Any, max_model_len: int = 8192) -> Any:
    """An engine (no tokenizer) around an in-memory model, its KV pool sized like `build_engine` does;
    on CUDA with `options.cuda_graphs == "auto"` its decode steps are captured as graphs, as there."""
    from backends.torch_llm.engine import EngineConfig, LLMEngine
    from backends.torch_llm.factory import num_kv_blocks, prefill_cap_with_decodes
    from backends.torch_llm.runner import ModelRunner, kv_bytes_per_block

    param = next(model.parameters())
    per_block = kv_bytes_per_block(model, options.block_size, param.dtype)
    blocks = num_kv_blocks(options, per_block, param.device)
    graphs = options.cuda_graphs == "auto" and param.device.type == "cuda"
    runner = ModelRunner(
        model, num_blocks=blocks, block_size=options.block_size, attention=options.attention_backend,
        spare_block=graphs,
    )  # fmt: skip
    max_len = min(max_model_len, blocks * options.block_size)
    if graphs:
        runner.use_decode_graphs(max_num_seqs, max_len)
    return LLMEngine.create(
        runner,
        None,
        EngineConfig(max_model_len=max_len, eos_token_ids=frozenset()),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_prefill_tokens_with_decodes=prefill_cap_with_decodes(options, param.device),
        enable_prefix_caching=False,
    )


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: Any, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes moved per second (read + write) by a `copy_` of `nbytes`, best of `repeats`."""
    import torch

    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * nbytes / best


def measure_decode(
    engine: Any, cfg: ModelConfig, elem_bytes: int, *, batch: int, prompt_len: int, warmup: int, steps: int
) -> dict[str, float]:
    """Prefill `batch` random prompts, then time `steps` decode steps of the whole batch."""
    start_batch(engine, cfg, batch=batch, prompt_len=prompt_len, warmup=warmup)
    row = time_decode_steps(engine, cfg, elem_bytes, steps)
    end_batch(engine)
    return row


def start_batch(engine: Any, cfg: ModelConfig, *, batch: int, prompt_len: int, warmup: int) -> None:
    """Add `batch` random prompts, prefill them all, then run `warmup` decode steps."""
    import random

    rng = random.Random(batch)
    # Never finishes by itself (aborted by `end_batch`): early sequences decode while later ones prefill.
    params = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(cfg.vocab_size) for _ in range(prompt_len)]
        engine.add_request(f"b{batch}-{i}", prompt, params)
    sched = engine.scheduler
    while len(sched.waiting) or any(s.num_output_tokens == 0 for s in sched.running):
        engine.step()  # prefill (chunked) until every sequence has its first token
    for _ in range(warmup):
        engine.step()
    if len(sched.running) != batch:
        raise RuntimeError(f"only {len(sched.running)} of {batch} sequences fit the KV pool")


def time_decode_steps(engine: Any, cfg: ModelConfig, elem_bytes: int, steps: int) -> dict[str, Any]:
    """Time `steps` decode steps of every running sequence (eager or from graphs, as the runner is set)."""
    sched = engine.scheduler
    ctx_start = [s.num_tokens for s in sched.running]
    device = engine.runner.device
    graphs = engine.runner.graphs
    replays_before = graphs.replays if graphs is not None else 0
    _sync(device)
    t = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += len(engine.step())
    _sync(device)
    elapsed = time.perf_counter() - t
    replayed = (graphs.replays - replays_before) if graphs is not None else 0
    mid_ctx = [c + steps // 2 for c in ctx_start]  # KV read per step grows by one token per step
    step_bytes = decode_bytes_per_step(cfg, elem_bytes, mid_ctx)
    return {
        "batch": len(ctx_start),
        "cuda_graphs": replayed > 0,  # a graph served the steps (not merely captured)
        "steps_replayed": replayed,  # of the timed steps, those a captured graph served
        "decode_tokens_per_s": tokens / elapsed,
        "step_time_s": elapsed / steps,
        "bytes_per_step": step_bytes,
        "kv_bytes_per_step": step_bytes - decode_bytes_per_step(cfg, elem_bytes, []),
        "bytes_per_s": step_bytes * steps / elapsed,
    }


def end_batch(engine: Any) -> None:
    for s in list(engine.scheduler.running):
        engine.abort(s.request_id)


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over rounds per (batch, eager or graphs), and each batch's graphs-over-eager ratio."""
    import statistics

    keys = ("decode_tokens_per_s", "step_time_s", "bandwidth_utilisation")
    out = []
    for batch in sorted({r["batch"] for r in rows}):
        entry: dict[str, Any] = {"batch": batch}
        for mode, graphs in (("eager", False), ("graphs", True)):
            mine = [r for r in rows if r["batch"] == batch and r["cuda_graphs"] == graphs]
            if mine:
                entry[mode] = {k: statistics.median(r[k] for r in mine) for k in keys}
                entry[mode]["steps_replayed"] = sum(r["steps_replayed"] for r in mine)
        if "eager" in entry and "graphs" in entry:
            entry["graphs_over_eager_tokens_per_s"] = (
                entry["graphs"]["decode_tokens_per_s"] / entry["eager"]["decode_tokens_per_s"]
            )
        out.append(entry)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--attention", choices=("auto", "torch", "triton"), default="auto")
    ap.add_argument(
        "--cuda-graphs", choices=("both", "auto", "off"), default="both",
        help="both: every batch timed eager and replayed from captured graphs, interleaved in each round",
    )  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the summary gives medians")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "llm_gpu.json")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        msg = "bench_llm_gpu: no CUDA device here; nothing measured, nothing written."
        sys.stderr.write(msg + "\n")
        return 0
    from backends.torch_llm.options import LLMOptions

    batches = [int(b) for b in args.batches.split(",")]
    cfg = model_config()
    dtype, device = torch.bfloat16, torch.device("cuda")
    model = build_random_model(cfg, device, dtype)
    options = LLMOptions(
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=4096, max_prefill_tokens_with_decodes=4096,  # prefill fast, uncapped
        attention_backend=args.attention, dtype="bfloat16",
        cuda_graphs="off" if args.cuda_graphs == "off" else "auto",
    )  # fmt: skip
    engine = build_engine_for(model, max_num_seqs=max(batches), options=options)
    captured = engine.runner.graphs
    modes = {"both": [False, True], "auto": [True], "off": [False]}[args.cuda_graphs]
    if True in modes and captured is None:
        raise SystemExit(
            "bench_llm_gpu: decode graphs were not captured (see the llm_cuda_graphs_* log line)"
        )
    bandwidth = copy_bandwidth(device)
    rows = []
    for batch in batches:  # one prefill per batch; the modes then alternate over the same sequences
        start_batch(engine, cfg, batch=batch, prompt_len=args.prompt_len, warmup=args.warmup)
        # batches past the largest graph run eagerly either way: timed once per round, as eager
        fits = captured is not None and captured.size_for(batch) is not None
        batch_modes = modes if fits else [False]
        for round_ in range(args.rounds):
            # eager first in even rounds, graphs first in odd ones: contexts grow by --steps a turn,
            # so a fixed order would hand every later turn more keys to read
            for use_graphs in batch_modes if round_ % 2 == 0 else batch_modes[::-1]:
                engine.runner.graphs = captured if use_graphs else None
                row = time_decode_steps(engine, cfg, 2, args.steps)
                row["round"] = round_
                row["bandwidth_utilisation"] = row["bytes_per_s"] / bandwidth
                rows.append(row)
                log.info("bench_llm_gpu_batch", **{k: round(v, 4) for k, v in row.items()})
        end_batch(engine)
    engine.runner.graphs = captured
    attention = engine.runner.attention
    result = {
        "setup": {
            "model": "Llama-3-8B shape, random weights, bfloat16",
            "parameters": parameter_count(cfg),
            "kv_bytes_per_token": kv_bytes_per_token(cfg, 2),
            "prompt_len": args.prompt_len,
            "warmup_steps": args.warmup,
            "timed_steps": args.steps,
            "block_size": args.block_size,
            "kv_blocks": engine.runner.num_blocks,
            "attention": attention.name,
            "attention_fallback_reason": getattr(attention, "disabled_reason", None),
            "cuda_graphs": args.cuda_graphs,
            "graph_batch_sizes": captured.sizes if captured is not None else [],
            "graph_check_relative_errors": captured.check_errors if captured is not None else [],
            "rounds": args.rounds,
            "gpu": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "host": platform.node(),
        },
        "copy_bandwidth_bytes_per_s": bandwidth,
        "decode": rows,
        "summary": summarise(rows),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    from bench.plots import plot_llm_gpu  # the PNG beside the JSON (bench/plots.py)

    plot_llm_gpu(result, args.out.with_suffix(".png"))
    sys.stdout.write(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
