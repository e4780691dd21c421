"""Benchmark weight-only int8 (`quantization: int8`) against the float model on CPU.

One random-weight Llama is written once and loaded as separate models: the float model, the int8 model
(`quantize_linears` after `load_model`, auto kernel paths) and, as a reference, the int8 model with every
layer forced onto the "dequant" path (float32 activations throughout, no bfloat16 kernel); for a float32
run also the float model loaded in bfloat16, a yardstick for how much greedy agreement a random-weight
model keeps under an accepted precision loss (its near-ties flip easily). Each gets its own engine (no prefix caching, so every round recomputes) and the variants are measured in interleaved
rounds (order rotated each round); figures are medians over rounds.

- weight memory: `weight_bytes(model)` (every parameter and buffer, tied weights once) and the bytes of
  the decoder projections alone;
- batch-1 decode tokens/s: one request (greedy, ignore_eos, 64 tokens) through the engine, decode steps
  only (the prefill step is not timed);
- batched tokens/s: 16 requests added at once, all output tokens / time to finish (prefill included);
- agreement: the batched runs' greedy outputs vs the float model's, position by position (fraction of
  identical tokens; first divergence per prompt);
- logit error: the int8 model teacher-forced on the float model's greedy tokens (same contexts), max and
  RMS |logit difference| over every step of every prompt, and the float logits' scale for comparison.

Times are read from two clocks: wall time, and this thread's CPU time (torch runs on this thread with
--threads 1; time the shared machine's other processes take from this one does not count). Writes
bench/results/llm_int8.json and .png.

    .venv/bin/python -m bench.bench_llm_int8
    .venv/bin/python -m bench.bench_llm_int8 --pad-vocab 32000 --out bench/results/llm_int8_vocab32k.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import random
import statistics
import tempfile
import time

import torch

from backends.base import SamplingParams
from backends.demo_models.tiny_llama import write_tiny_llama
from backends.torch_llm.engine import EngineConfig, LLMEngine
from backends.torch_llm.kernels.packed_linear import PackedLinear, fuse_projections, pack_linears
from backends.torch_llm.model.loader import DTYPES, load_model
from backends.torch_llm.model.quantization import Int8Linear, quantize_linears, set_kernel, weight_bytes
from backends.torch_llm.runner import ModelRunner
from backends.torch_llm.sequence import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
BLOCK = 16


class Clocks:
    """Wall and this-thread CPU seconds since `start()`."""

    def start(self) -> None:
        self.w0, self.c0 = time.perf_counter(), time.thread_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.w0, time.thread_time() - self.c0


def make_engine(model: torch.nn.Module, num_blocks: int, max_len: int, vocab: int) -> LLMEngine:
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK)
    config = EngineConfig(max_model_len=max_len, eos_token_ids=frozenset(), vocab_size=vocab)
    return LLMEngine.create(
        runner, None, config, max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False
    )


def batch1(engine: LLMEngine, prompt: list[int], tokens: int, tag: str) -> dict:
    engine.add_request(tag, prompt, SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill + first token, not timed
    clocks, n = Clocks(), 0
    clocks.start()
    while engine.has_unfinished:
        n += sum(len(o.token_ids) for o in engine.step())
    wall, cpu = clocks.read()
    return {"tokens": n, "wall_tok_s": n / wall, "cpu_tok_s": n / cpu}


def batched(
    engine: LLMEngine, prompts: list[list[int]], tokens: int, tag: str
) -> tuple[dict, list[list[int]]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outputs: list[list[int]] = [[] for _ in prompts]
    clocks = Clocks()
    clocks.start()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    while engine.has_unfinished:
        for o in engine.step():
            outputs[int(o.request_id.rsplit("-", 1)[1])].extend(o.token_ids)
    wall, cpu = clocks.read()
    n = sum(len(o) for o in outputs)
    return {"tokens": n, "wall_tok_s": n / wall, "cpu_tok_s": n / cpu}, outputs


def teacher_forced_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits of `model` predicting each of `tokens` after the prompt and the previous ones."""
    runner = ModelRunner(model, num_blocks=-(-(len(prompt) + len(tokens)) // BLOCK), block_size=BLOCK)
    seq = Sequence(0, "tf", prompt, max_tokens=len(tokens))
    seq.block_table = list(range(runner.num_blocks))
    rows = []
    for tok in tokens:
        logits, _ = runner.execute([(seq, seq.num_uncomputed_tokens)])
        seq.num_computed_tokens = seq.num_tokens
        rows.append(logits[0])
        seq.append_token(tok)
    return torch.stack(rows)


def decoder_linear_bytes(model: torch.nn.Module) -> int:
    total = 0
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] not in PROJECTIONS:
            continue
        if isinstance(m, Int8Linear):
            total += m.weight_bytes()
        elif isinstance(m, PackedLinear):
            w = m.packed_weight
            total += w.numel() * w.element_size() + (0 if m.bias is None else m.bias.numel() * m.bias.element_size())
        else:
            total += sum(t.numel() * t.element_size() for t in (m.weight, m.bias) if t is not None)
    return total


def kernel_paths(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, list[str]]:
    """The path each projection of layer 0 takes in a 1-row (batch-1 decode), 16-row and 512-row step."""
    out: dict[str, list[str]] = {}
    layer0 = model.model.layers[0]
    for name in PROJECTIONS:
        m = getattr(layer0.self_attn, name, None) or getattr(layer0.mlp, name, None)
        if isinstance(m, Int8Linear):
            out[name] = [m.path_for(torch.zeros(r, m.in_features, dtype=dtype)) for r in (1, 16, 512)]
    return out


def med(rounds: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rounds)


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["variants"])
    data = result["variants"]
    colors = [f"C{i}" for i in range(len(names))]
    fig, ax = plt.subplots(1, 4, figsize=(16, 4))
    ax[0].bar(names, [data[n]["weight_bytes"] / 2**20 for n in names], color=colors, label="whole model")
    ax[0].bar(names, [data[n]["decoder_linear_bytes"] / 2**20 for n in names], color="k", alpha=0.3,
              label="decoder projections")  # fmt: skip
    ax[0].set_title("weight memory (MiB)")
    ax[0].legend(fontsize=7)
    for i, (key, title) in enumerate(
        [("batch1", "batch-1 decode tok/s"), ("batched", "16 in flight: tok/s")]
    ):
        a = ax[1 + i]
        cpu = [data[n][key]["cpu_tok_s_median"] for n in names]
        wall = [data[n][key]["wall_tok_s_median"] for n in names]
        xs = range(len(names))
        a.bar([x - 0.2 for x in xs], cpu, 0.4, label="CPU clock")
        a.bar([x + 0.2 for x in xs], wall, 0.4, label="wall clock")
        a.set_xticks(list(xs), names)
        a.set_title(title)
        a.legend(fontsize=7)
    quality = [n for n in names if "agreement" in data[n]]
    ax[3].bar(quality, [data[n]["agreement"]["fraction_identical"] for n in quality], color=colors[1:])
    for x, n in enumerate(quality):
        err = data[n]["logit_error"]
        ax[3].text(
            x, 0.05, f"max|dlogit| {err['max_abs']:.3g}\nrms {err['rms']:.2g}", ha="center", fontsize=7
        )
    ax[3].set_ylim(0, 1)
    ax[3].set_title("greedy tokens identical to float")
    fig.suptitle(result["setup"]["summary"], fontsize=9)
    fig.tight_layout()
    from bench import plotting  # bench/plotting.py: the footer with the date and machine
    plotting.save(fig, path)


def main() -> None:  # noqa: C901 - a linear script
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=1376)
    ap.add_argument("--pad-vocab", type=int, default=None, help="model vocabulary (default: the tokenizer's)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument("--requests", type=int, default=16, help="requests in flight in the batched run")
    ap.add_argument("--no-bf16-reference", action="store_true", help="skip the bfloat16 yardstick model")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "llm_int8.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = DTYPES[args.dtype]
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_llama(
            pathlib.Path(tmp) / "m", hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
            num_kv_heads=args.heads, intermediate_size=args.intermediate, pad_vocab_to=args.pad_vocab, seed=0,
        )  # fmt: skip
        cfg = json.loads((folder / "config.json").read_text())
        vocab = cfg["vocab_size"]
        prompts = [
            [0] + [rng.randrange(6, vocab) for _ in range(rng.randint(15, 63))] for _ in range(args.requests)
        ]
        # each model as the engine's factory builds it on CPU: float = fused + oneDNN-packed linears,
        # int8 = int8 decoder projections + packed LM head; plus the plain F.linear float model
        models = {"float": load_model(folder, torch.device("cpu"), dtype)}
        fuse_projections(models["float"])
        pack_linears(models["float"])
        models["float_f_linear"] = load_model(folder, torch.device("cpu"), dtype)
        for name, kernel in (("int8", "auto"), ("int8_dequant", "dequant")):
            m = load_model(folder, torch.device("cpu"), dtype)
            quantize_linears(m)
            set_kernel(m, kernel)
            pack_linears(m)
            models[name] = m
        if dtype == torch.float32 and not args.no_bf16_reference:
            models["bfloat16"] = load_model(folder, torch.device("cpu"), torch.bfloat16)
    max_len = 64 + args.tokens + 1
    blocks = args.requests * -(-max_len // BLOCK) + 4
    engines = {n: make_engine(m, blocks, max_len, vocab) for n, m in models.items()}
    names = list(models)
    for n in names:  # warm-up: first calls allocate and pick kernels
        batch1(engines[n], prompts[0], 4, f"warm-{n}")
    rounds: dict[str, dict[str, list[dict]]] = {n: {"batch1": [], "batched": []} for n in names}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            rounds[n]["batch1"].append(batch1(engines[n], prompts[0], args.tokens, f"b1-{r}"))
            stats, outs = batched(engines[n], prompts, args.tokens, f"bt{r}")
            rounds[n]["batched"].append(stats)
            outputs.setdefault(n, outs)
            assert outs == outputs[n], f"{n}: greedy outputs changed between rounds"
    variants: dict[str, dict] = {}
    for n in names:
        v: dict = {
            "weight_bytes": weight_bytes(models[n]),
            "decoder_linear_bytes": decoder_linear_bytes(models[n]),
        }
        for key in ("batch1", "batched"):
            v[key] = {
                "cpu_tok_s_median": med(rounds[n][key], "cpu_tok_s"),
                "wall_tok_s_median": med(rounds[n][key], "wall_tok_s"),
                "rounds": rounds[n][key],
            }
        if n != "float":
            if n.startswith("int8"):
                v["kernel_paths_layer0"] = kernel_paths(models[n], dtype)
            same = total = 0
            first = []
            for ref, got in zip(outputs["float"], outputs[n], strict=True):
                same += sum(a == b for a, b in zip(ref, got, strict=True))
                total += len(ref)
                first.append(next((i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b), None))
            v["agreement"] = {
                "fraction_identical": same / total,
                "prompts_identical": sum(f is None for f in first),
                "first_divergence": first,
            }
            errs, scale, teacher_same, float_rows = [], 0.0, 0, []
            for p, ref in zip(prompts, outputs["float"], strict=True):
                with torch.inference_mode():
                    fl = teacher_forced_logits(models["float"], p, ref)
                    ql = teacher_forced_logits(models[n], p, ref)
                errs.append((fl - ql).abs().flatten())
                scale = max(scale, float(fl.abs().max()))
                float_rows.append(fl)
                teacher_same += int((fl.argmax(-1) == ql.argmax(-1)).sum())
            err = torch.cat(errs)
            v["logit_error"] = {
                "max_abs": float(err.max()),
                "rms": float(err.pow(2).mean().sqrt()),
                "float_logit_max_abs": scale,
                "float_logit_rms": float(torch.cat(float_rows).pow(2).mean().sqrt()),
                # how close the float model's own top-2 are: random weights give near-ties everywhere
                "float_top2_gap_median": float(
                    torch.cat(float_rows).topk(2, -1).values.diff(dim=-1).abs().median()
                ),
                "teacher_forced_top1_agreement": teacher_same / total,
            }
        variants[n] = v
    for n in names:
        if n != "float":
            variants[n]["vs_float"] = {
                "weight_bytes": variants[n]["weight_bytes"] / variants["float"]["weight_bytes"],
                "decoder_linear_bytes": variants[n]["decoder_linear_bytes"]
                / variants["float"]["decoder_linear_bytes"],
                **{
                    f"{key}_{clock}_tok_s": variants[n][key][f"{clock}_tok_s_median"]
                    / variants["float"][key][f"{clock}_tok_s_median"]
                    for key in ("batch1", "batched")
                    for clock in ("cpu", "wall")
                },
            }
    summary = (
        f"Llama h{args.hidden} L{args.layers} inter {args.intermediate} vocab {vocab} {args.dtype}, CPU "
        f"{args.threads} thread(s); median of {args.rounds} interleaved rounds"
    )
    result = {
        "setup": {
            "summary": summary,
            "model": {
                "hidden": args.hidden,
                "layers": args.layers,
                "heads": args.heads,
                "kv_heads": args.heads,
                "intermediate": args.intermediate,
                "vocab": vocab,
                "dtype": args.dtype,
            },
            "decoding": f"greedy, ignore_eos, {args.tokens} tokens per request",
            "batch1_prompt_tokens": len(prompts[0]),
            "batched_requests": args.requests,
            "prompt_tokens": [len(p) for p in prompts],
            "torch_threads": args.threads,
            "rounds": args.rounds,
            "machine": platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__,
            "variants": {
                "float": "the model as loaded",
                "int8": "quantize_linears (auto kernel paths)",
                "int8_dequant": "quantize_linears, every layer forced to the dequant path",
                "bfloat16": "the float model loaded in bfloat16, no quantization (a yardstick for agreement)",
            },
        },  # fmt: skip
        "variants": variants,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    brief = {
        n: {k: v for k, v in d.items() if k not in ("batch1", "batched")}
        | {
            k: {c: round(d[k][f"{c}_tok_s_median"], 1) for c in ("cpu", "wall")}
            for k in ("batch1", "batched")
        }
        for n, d in variants.items()
    }
    print(json.dumps({"setup": summary, "variants": brief}, indent=2))  # noqa: T201 - a script's report


if __name__ == "__main__":
    main()
