"""Multi-LoRA throughput of the torch_llm engine: 1, 8 and 64 distinct adapters in flight vs the base.

The same random-weight Llama as bench_llm_engine (hidden 512, 8 layers, vocab 32000, fp32), the first
`--requests` requests of the chat-mix trace (prompt and output lengths from the trace, capped),
submitted together (the engine saturated: throughput, not latency), greedy with ignore_eos so every
request makes exactly its max_tokens. Modes, interleaved round by round, medians reported:

- `base`: an engine without LoRA layers;
- `base+lora-layers`: LoRA layers present, every request on the base (the cost of having LoRA on);
- `1`, `8`, `64`: requests spread round-robin over that many distinct adapters (rank `--rank` on all
  seven projections: the heaviest kind), with `max_loras` slots for all of them.

Adapters are written in PEFT's layout (adapter_config.json + adapter_model.safetensors with PEFT's
key names) from random tensors; tests/backends/torch_llm/test_lora.py checks that layout against PEFT itself.
The clock is this thread's CPU time (torch on this thread, --threads 1), so other processes on the
shared machine do not count. Writes bench/results/lora.json and lora.png.

    .venv/bin/python -m bench.bench_lora --requests 64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from backends.base import SamplingParams
from backends.demo_models.tiny_llama import write_tiny_llama
from backends.torch_llm.factory import build_engine
from backends.torch_llm.lora.weights import linear_shapes, load_adapter
from backends.torch_llm.model.config import ModelConfig
from backends.torch_llm.options import LLMOptions
from bench.bench_llm_engine import TRACE, load_trace

ROOT = pathlib.Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"


def write_random_adapter(out: pathlib.Path, cfg: ModelConfig, rank: int, seed: int) -> pathlib.Path:
    """A LoRA adapter on all seven projections in PEFT's file layout."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for proj, (fan_in, fan_out) in linear_shapes(cfg).items():
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(linear_shapes(cfg)),
    }
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def run(
    folder: pathlib.Path,
    reqs: list[dict],
    adapters: list[pathlib.Path],
    n_adapters: int | None,
    lora_layers: bool,
    args,
) -> dict:  # noqa: ANN001, E501
    """One engine run; `n_adapters` None = every request on the base."""
    opts = LLMOptions(
        block_size=16, kv_cache_bytes=1 << 30, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048,
        enable_lora=lora_layers, max_loras=max(1, len(adapters)), max_lora_rank=args.rank,
    )  # fmt: skip
    parts = build_engine(folder, opts, device="cpu", with_tokenizer=False)
    engine = parts.engine
    cfg = parts.config
    names = []
    if lora_layers:
        for i, path in enumerate(adapters[: n_adapters or 0]):
            parts.lora.add(load_adapter(f"a{i}", path, cfg, max_rank=args.rank, dtype=torch.float32))
            names.append(f"a{i}")
    for i, r in enumerate(reqs):
        params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), r["prompt"], params, adapter=names[i % len(names)] if names else None)
    tokens = 0
    start = time.thread_time()
    steps = 0
    while engine.has_unfinished:
        tokens += sum(len(o.token_ids) for o in engine.step())
        steps += 1
    elapsed = time.thread_time() - start
    return {
        "output_tokens": tokens,
        "cpu_s": elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "steps": steps,
        "page_ins": parts.lora.num_page_ins if parts.lora is not None else 0,
    }


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    tps = [result["modes"][m]["output_tokens_per_s_median"] for m in modes]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(modes, tps, color=["#555"] * 2 + ["#1f77b4"] * (len(modes) - 2))
    for bar, m in zip(bars, modes, strict=True):
        ratio = result["modes"][m]["vs_base"]
        ax.annotate(
            f"{ratio:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom"
        )
    ax.set_ylabel("output tokens/s (CPU time, median)")
    ax.set_xlabel("requests on: the base / N distinct adapters")
    ax.set_title(result["setup"]["summary"], fontsize=8)
    fig.tight_layout()
    from bench import plotting  # bench/plotting.py: the footer with the date and machine
    plotting.save(fig, path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "lora.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    counts = [1, 8, 64]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_llama(
            pathlib.Path(tmp) / "m", hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8,
            intermediate_size=512 * 11 // 4, pad_vocab_to=32000, max_position_embeddings=2048, seed=0,
        )  # fmt: skip
        cfg = ModelConfig.from_folder(folder)
        adapters = [
            write_random_adapter(pathlib.Path(tmp) / f"a{i}", cfg, args.rank, i) for i in range(max(counts))
        ]
        reqs = load_trace(TRACE, args.requests, 1.0, args.max_prompt, args.max_output, 32000)
        modes = {"base": (None, False), "base+lora-layers": (None, True)} | {
            str(n): (n, True) for n in counts
        }
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for round_ in range(args.rounds):
            for mode, (n, layers) in modes.items():
                out = run(folder, reqs, adapters[: n or 0] if layers else [], n, layers, args)
                runs[mode].append(out)
                print(f"round {round_} {mode:>17}: {out['output_tokens_per_s']:7.1f} tok/s", flush=True)
    base = statistics.median(r["output_tokens_per_s"] for r in runs["base"])
    result = {
        "setup": {
            "summary": (
                f"Llama h512 L8 vocab 32000 fp32, CPU 1 thread; {len(reqs)} chat-mix requests at once, "
                f"LoRA rank {args.rank} on all 7 projections; {args.rounds} interleaved rounds"
            ),
            "requests": len(reqs),
            "rank": args.rank,
            "rounds": args.rounds,
            "max_num_seqs": args.max_num_seqs,
            "clock": "thread CPU time",
        },
        "modes": {
            m: {
                "output_tokens_per_s_median": statistics.median(r["output_tokens_per_s"] for r in rs),
                "vs_base": statistics.median(r["output_tokens_per_s"] for r in rs) / base,
                "runs": rs,
            }
            for m, rs in runs.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    for m, v in result["modes"].items():
        print(f"{m:>17}: {v['output_tokens_per_s_median']:7.1f} tok/s  {v['vs_base']:.2f}x base")


if __name__ == "__main__":
    main()
