"""Where a decode step's time goes on one CUDA GPU (the model and engine of bench_llm_gpu.py).

For each batch size, with the running batch prefilled once: the wall time of a whole engine step
with graphs and eager; the GPU time of the captured backbone alone (graph replays timed with CUDA
events, no host work between them); the LM head and argmax alone; the host time of the step's
Python (schedule, input preparation, sampling, append) as the remainder. Then a torch.profiler
table of a few eager steps and a few graph steps: kernels by GPU time, operators by host time.
Writes `--out` (JSON) and one profile table per batch and mode beside it (`.txt`).

    python3 -m bench.profile_llm_gpu --batches 1,32 --out bench/results/llm_gpu_profile.json
    python3 -m bench.profile_llm_gpu --tiny   # the same on CPU with a tiny model: checks the script
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any

from bench import bench_llm_gpu as bench

ROOT = pathlib.Path(__file__).resolve().parents[1]

TINY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


def _timed(fn: Any, repeats: int, device: Any) -> float:
    """Median seconds of `fn()` over `repeats`, each synchronised (CUDA events on a GPU)."""
    import torch

    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def _step_wall(engine: Any, steps: int) -> float:
    times = []
    for _ in range(steps):
        bench._sync(engine.runner.device)
        t = time.perf_counter()
        engine.step()
        bench._sync(engine.runner.device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _profile_table(engine: Any, steps: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if engine.runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        bench._sync(engine.runner.device)
    averages = prof.key_averages()
    parts = []
    if engine.runner.device.type == "cuda":
        parts.append(averages.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    parts.append(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    return "\n".join(parts)


def profile_batch(
    engine: Any, cfg: Any, batch: int, args: argparse.Namespace, out: pathlib.Path
) -> dict[str, Any]:
    import torch

    runner = engine.runner
    device = runner.device
    captured = runner.graphs
    bench.start_batch(engine, cfg, batch=batch, prompt_len=args.prompt_len, warmup=4)
    row: dict[str, Any] = {"batch": batch}
    for mode, graphs in (("eager", None), ("graphs", captured)):
        if mode == "graphs" and captured is None:
            continue
        runner.graphs = graphs
        row[f"{mode}_step_s"] = _step_wall(engine, args.steps)
        (out.parent / f"{out.stem}_b{batch}_{mode}.txt").write_text(
            _profile_table(engine, args.profile_steps)
        )
    runner.graphs = captured
    hidden = torch.randn(batch, cfg.hidden_size, device=device, dtype=next(runner.model.parameters()).dtype)
    row["lm_head_argmax_s"] = _timed(lambda: runner.model.logits(hidden).argmax(-1), args.steps, device)
    if captured is not None and captured.size_for(batch) is not None:
        size = captured.size_for(batch)
        graph = captured._graphs[size]  # the captured backbone alone: its GPU time, no host work
        row["graph_replay_s"] = _timed(graph.replay, args.steps, device)
        row["graph_host_to_replay_s"] = row["graphs_step_s"] - row["graph_replay_s"] - row["lm_head_argmax_s"]
    bench.end_batch(engine)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32, help="timed steps (medians)")
    ap.add_argument("--profile-steps", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="a tiny float32 model on CPU (checks the script)")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results" / "llm_gpu_profile.json")
    args = ap.parse_args(argv)
    import torch

    from backends.torch_llm.options import LLMOptions

    if args.tiny:
        cfg, device, dtype = bench.model_config(**TINY), torch.device("cpu"), torch.float32
        options = LLMOptions(block_size=16, kv_cache_bytes=64 << 20, max_num_batched_tokens=512)
    elif not torch.cuda.is_available():
        sys.stderr.write("profile_llm_gpu: no CUDA device here (--tiny runs on CPU); nothing measured.\n")
        return 0
    else:
        cfg, device, dtype = bench.model_config(), torch.device("cuda"), torch.bfloat16
        options = LLMOptions(
            block_size=16, gpu_memory_utilization=0.9, max_num_batched_tokens=4096,
            max_prefill_tokens_with_decodes=4096, dtype="bfloat16",
        )  # fmt: skip
    batches = [int(b) for b in args.batches.split(",")]
    model = bench.build_random_model(cfg, device, dtype)
    engine = bench.build_engine_for(model, max_num_seqs=max(batches), options=options)
    args.out.parent.mkdir(parents=True, exist_ok=True)  # the profile tables land there first
    rows = [profile_batch(engine, cfg, b, args, args.out) for b in batches]
    result = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2))
    for r in rows:
        sys.stdout.write(
            " ".join(f"{k}={v * 1e3:.3f}ms" if k != "batch" else f"batch={v}" for k, v in r.items()) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
