"""Benchmark the torch_llm engine against transformers static batching on the chat-mix trace.

Both systems replay the same requests open-loop (request i is released at its trace time x scale)
against the same random-weight Llama, one after the other in one run, with the same torch thread
count. Greedy decoding with ignore_eos, so every request produces exactly its `max_tokens`.

(a) engine: continuous batching, paged KV cache, chunked prefill, driven step by step on this thread.
(b) transformers: `generate()` on static batches of up to `--hf-batch` arrived requests (left-padded);
    a batch runs until its longest request is done, new arrivals wait for the next batch. Token times
    are taken from a logits processor that runs once per generation step.

Also: KV waste of the engine vs reserving max length per sequence (at block size 16 and, in a second
engine run, 8), and batch-1 decode tokens/s as a fraction of the memory-bandwidth bound (bytes of
weights + KV read per step / measured memcpy bandwidth). Writes bench/results/llm_engine.json and .png.

Clock (`--clock`): `wall` measures real time. `cpu` measures this thread's CPU time instead (torch
runs on this thread with --threads 1): idle waits for the next arrival advance the clock instead of
sleeping, and time the shared machine's other processes take from this one does not count, so the
figures are those of a dedicated core (memory-bandwidth contention still shows). Both systems always
use the same clock.

    .venv/bin/python -m bench.bench_llm_engine --requests 80 --scale 1 --clock cpu
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import random
import tempfile
import time

import msgspec
import torch

from backends.base import SamplingParams
from backends.demo_models.tiny_llama import write_tiny_llama
from backends.torch_llm.factory import build_engine
from backends.torch_llm.model.costs import kv_bytes_per_token, weight_bytes_per_step
from backends.torch_llm.options import LLMOptions

ROOT = pathlib.Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "workloads" / "chat-mix.jsonl"
RESULTS = ROOT / "bench" / "results"


class ReplayClock:
    """Seconds since `start()`: wall time, or this thread's CPU time plus skipped idle waits."""

    def __init__(self, kind: str) -> None:
        if kind not in ("wall", "cpu"):
            raise ValueError(f"unknown clock {kind!r}")
        self.kind = kind
        self._read = time.perf_counter if kind == "wall" else time.thread_time
        self._origin = self._read()
        self._skipped = 0.0

    def start(self) -> None:
        self._origin, self._skipped = self._read(), 0.0

    def now(self) -> float:
        return self._read() - self._origin + self._skipped

    def wait_until(self, t: float) -> None:
        gap = t - self.now()
        if gap <= 0:
            return
        if self.kind == "wall":
            time.sleep(gap)
        else:
            self._skipped += gap


def load_trace(
    path: pathlib.Path, n: int, scale: float, max_prompt: int, max_out: int, vocab: int
) -> list[dict]:
    reqs = []
    for line in path.read_text().splitlines()[:n]:
        r = json.loads(line)
        rng = random.Random(r["seed"])
        plen = min(r["prompt_tokens"], max_prompt)
        reqs.append(
            {
                "t": r["t"] * scale,
                "tenant": r["tenant"],
                "prompt": [0] + [rng.randrange(6, vocab) for _ in range(plen - 1)],
                "max_tokens": max(1, min(r["max_tokens"], max_out)),
            }
        )
    t0 = reqs[0]["t"]
    for r in reqs:
        r["t"] -= t0
    return reqs


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summarize(reqs: list[dict], times: dict[int, list[float]], makespan: float) -> dict:
    ttft = [times[i][0] - r["t"] for i, r in enumerate(reqs)]
    itl = [b - a for i in times for a, b in zip(times[i], times[i][1:], strict=False)]
    e2e = [times[i][-1] - r["t"] for i, r in enumerate(reqs)]
    out_tokens = sum(len(v) for v in times.values())
    return {
        "output_tokens": out_tokens,
        "makespan_s": makespan,
        "output_tokens_per_s": out_tokens / makespan,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
        "e2e_p50_s": pct(e2e, 50),
        "e2e_p99_s": pct(e2e, 99),
        "ttft_all_s": ttft,
    }


def run_engine(
    folder: pathlib.Path, reqs: list[dict], opts: LLMOptions, clock: ReplayClock
) -> tuple[dict, dict]:
    engine = build_engine(folder, opts, device="cpu", deployment=f"bench-bs{opts.block_size}").engine
    engine.add_request("warm", [0, 7, 8, 9], SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished:
        engine.step()
    times: dict[int, list[float]] = {i: [] for i in range(len(reqs))}
    clock.start()
    nxt = 0
    while nxt < len(reqs) or engine.has_unfinished:
        now = clock.now()
        while nxt < len(reqs) and reqs[nxt]["t"] <= now:
            r = reqs[nxt]
            params = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
            engine.add_request(str(nxt), r["prompt"], params, cache_scope=r["tenant"])
            nxt += 1
        if not engine.has_unfinished:
            clock.wait_until(reqs[nxt]["t"])
            continue
        outs = engine.step()
        stamp = clock.now()
        for o in outs:
            if o.request_id != "warm":
                times[int(o.request_id)].extend([stamp] * len(o.token_ids))
    makespan = clock.now()
    w = engine.kv_waste
    kv = {
        "engine_waste": w.ratio(),
        "reserve_max_model_len_waste": w.ratio(w.reserved_max_len),
        "reserve_prompt_plus_max_tokens_waste": w.ratio(w.reserved_request),
        "mean_unused_slots_per_running_seq": w.mean_unused_slots,
        "mean_allocated_slots_per_running_seq": w.mean_allocated_slots,
        "expected_waste_if_last_block_half_empty": (opts.block_size - 1) / 2 / w.mean_allocated_slots,
        "max_model_len": engine.config.max_model_len,
        "block_size": opts.block_size,
        "steps": engine.num_steps,
        "preemptions": engine.scheduler.num_preemptions,
        "prefix_hit_tokens": engine.num_prefix_hits,
        "attention": engine.runner.attention.name,
        "max_prefill_tokens_with_decodes": engine.scheduler.max_prefill_tokens_with_decodes,
    }
    return summarize(reqs, times, makespan), kv


class _StepClock:
    """A transformers LogitsProcessor that timestamps every generation step."""

    def __init__(self, clock: ReplayClock) -> None:
        self.clock, self.stamps = clock, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.stamps.append(self.clock.now())
        return scores


def run_hf(folder: pathlib.Path, reqs: list[dict], batch: int, clock: ReplayClock) -> dict:
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    times: dict[int, list[float]] = {}
    clock.start()
    nxt = 0
    while nxt < len(reqs):
        clock.wait_until(reqs[nxt]["t"])
        now = clock.now()
        ids = []
        while nxt < len(reqs) and reqs[nxt]["t"] <= now and len(ids) < batch:
            ids.append(nxt)
            nxt += 1
        width = max(len(reqs[i]["prompt"]) for i in ids)
        inp = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for row, i in enumerate(ids):  # left padding
            p = reqs[i]["prompt"]
            inp[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        stamps = _StepClock(clock)
        with torch.inference_mode():
            model.generate(
                inp,
                attention_mask=mask,
                max_new_tokens=max(reqs[i]["max_tokens"] for i in ids),
                do_sample=False,
                logits_processor=LogitsProcessorList([stamps]),
            )
        for i in ids:
            times[i] = stamps.stamps[: reqs[i]["max_tokens"]]
    return summarize(reqs, times, clock.now())


def memcpy_bandwidth(clock: ReplayClock, nbytes: int = 256 << 20) -> float:
    """Bytes moved per second (read + write) by a large tensor copy, best of 5."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = clock.now()
        dst.copy_(src)
        best = min(best, clock.now() - t)
    return 2 * nbytes / best


def batch1_decode(
    folder: pathlib.Path, opts: LLMOptions, clock: ReplayClock, prompt_len: int = 128, steps: int = 128
) -> dict:
    parts = build_engine(folder, opts, device="cpu", deployment="bench-b1")
    engine, cfg = parts.engine, parts.config
    engine.add_request(
        "b1",
        [0] + [7] * (prompt_len - 1),
        SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True),
    )
    engine.step()  # prefill + first token
    t = clock.now()
    n = 0
    while engine.has_unfinished:
        n += len(engine.step())
    dt = clock.now() - t
    elem = torch.empty((), dtype=parts.dtype).element_size()
    weight_bytes = weight_bytes_per_step(cfg, elem)
    kv_bytes = kv_bytes_per_token(cfg, elem) * (prompt_len + steps / 2)  # average context
    bw = memcpy_bandwidth(clock)
    tps = n / dt
    bound = bw / (weight_bytes + kv_bytes)
    return {
        "decode_tokens_per_s": tps,
        "weight_bytes_per_step": weight_bytes,
        "kv_bytes_per_step_avg": kv_bytes,
        "memcpy_bandwidth_bytes_per_s": bw,
        "bandwidth_bound_tokens_per_s": bound,
        "fraction_of_bound": tps / bound,
    }


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cap = result["setup"]["engine_options"].get("max_prefill_tokens_with_decodes")
    series = [(f"engine (cap {cap})", result["engine"])]
    for other, data in result.get("engine_other_prefill_caps", {}).items():
        series.append((f"engine (cap {other})", data))
    series.append(("HF static", result["transformers_static"]))
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    names = [n for n, _ in series]
    ax[0].bar(
        names, [d["output_tokens_per_s"] for _, d in series], color=[f"C{i}" for i in range(len(series))]
    )
    ax[0].set_title("output tokens/s")
    ax[0].tick_params(axis="x", labelsize=7, labelrotation=20)
    ax[0].set_xlabel("cap: prompt tokens per step that also decodes", fontsize=7)
    keys = ["ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"]
    width = 0.8 / len(series)
    for j, (name, data) in enumerate(series):
        ax[1].bar(
            [i + (j - (len(series) - 1) / 2) * width for i in range(4)],
            [data[k] for k in keys],
            width,
            label=name,
        )
    ax[1].set_xticks(range(4), ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"])
    ax[1].set_yscale("log")
    ax[1].set_ylabel("seconds")
    ax[1].legend(fontsize=7)
    for name, data in series:
        xs = sorted(data["ttft_all_s"])
        ax[2].plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    ax[2].set_xscale("log")
    ax[2].set_title("TTFT CDF")
    ax[2].legend(fontsize=7)
    fig.suptitle(result["setup"]["summary"])
    fig.tight_layout()
    from bench import plotting  # bench/plotting.py: the footer with the date and machine
    plotting.save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100, help="first N requests of the trace")
    ap.add_argument("--scale", type=float, default=3.0, help="multiply trace arrival times by this")
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--max-output", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument(
        "--max-prefill-with-decodes", type=int, default=None,
        help="engine option max_prefill_tokens_with_decodes (default: the engine's CPU default)",
    )  # fmt: skip
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument(
        "--waste-block-size", type=int, default=8, help="second engine run, for KV waste (0: skip)"
    )
    ap.add_argument(
        "--compare-prefill-caps", default="128,512",
        help="more engine runs with these max_prefill_tokens_with_decodes (512 = the budget: no cap); '' for none",
    )  # fmt: skip
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "llm_engine.json")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error("--clock cpu needs --threads 1 (it reads this thread's CPU time)")
    torch.set_num_threads(args.threads)
    clock = ReplayClock(args.clock)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_llama(
            pathlib.Path(tmp) / "m", hidden_size=args.hidden, num_layers=args.layers, num_heads=8, num_kv_heads=8,
            intermediate_size=args.hidden * 11 // 4, pad_vocab_to=32000, max_position_embeddings=2048, seed=0,
        )  # fmt: skip
        reqs = load_trace(TRACE, args.requests, args.scale, args.max_prompt, args.max_output, 32000)
        opts = LLMOptions(
            block_size=16, kv_cache_bytes=1 << 30, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=2048,
            max_prefill_tokens_with_decodes=args.max_prefill_with_decodes,
        )  # fmt: skip
        engine, kv = run_engine(folder, reqs, opts, clock)
        hf = run_hf(folder, reqs, args.hf_batch, clock)
        b1 = batch1_decode(folder, opts, clock)
        other_caps = {}
        for cap in [int(c) for c in args.compare_prefill_caps.split(",") if c]:
            capped = msgspec.structs.replace(opts, max_prefill_tokens_with_decodes=cap)
            other_caps[str(cap)], _ = run_engine(folder, reqs, capped, clock)
        kv_by_block = {16: kv}
        if args.waste_block_size:
            small = msgspec.structs.replace(opts, block_size=args.waste_block_size)
            other, kv_by_block[args.waste_block_size] = run_engine(folder, reqs, small, clock)
            kv_by_block[args.waste_block_size]["output_tokens_per_s"] = other["output_tokens_per_s"]
            kv_by_block[args.waste_block_size]["itl_p99_s"] = other["itl_p99_s"]
    summary = (
        f"Llama h{args.hidden} L{args.layers} vocab 32000 fp32, CPU {args.threads} thread(s); "
        f"{len(reqs)} chat-mix requests, time x{args.scale}, {args.clock} clock"
    )
    result = {
        "setup": {
            "summary": summary,
            "model": {
                "hidden": args.hidden,
                "layers": args.layers,
                "heads": 8,
                "kv_heads": 8,
                "intermediate": args.hidden * 11 // 4,
                "vocab": 32000,
                "dtype": "float32",
            },
            "requests": len(reqs),
            "time_scale": args.scale,
            "prompt_cap": args.max_prompt,
            "output_cap": args.max_output,
            "decoding": "greedy, ignore_eos (outputs are exactly max_tokens long)",
            "torch_threads": args.threads,
            "hf_static_batch": args.hf_batch,
            "engine_options": {
                "block_size": 16,
                "max_num_seqs": args.max_num_seqs,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "max_prefill_tokens_with_decodes": kv["max_prefill_tokens_with_decodes"],
                "attention": kv["attention"],
            },
            "clock": args.clock,
            "machine": platform.processor() or platform.machine(),
            "torch": torch.__version__,
        },  # fmt: skip
        "engine": engine,
        "transformers_static": hf,
        "engine_other_prefill_caps": other_caps,
        "ratios": {
            "tokens_per_s_engine_over_hf": engine["output_tokens_per_s"] / hf["output_tokens_per_s"],
            "ttft_p99_engine_over_hf": engine["ttft_p99_s"] / hf["ttft_p99_s"],
            "itl_p99_engine_over_hf": engine["itl_p99_s"] / hf["itl_p99_s"],
        },
        "kv_waste": kv,
        "kv_waste_by_block_size": {str(k): v for k, v in kv_by_block.items()},
        "batch1_decode": b1,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    brief = {
        k: v
        for k, v in result.items()
        if k not in ("engine", "engine_other_prefill_caps", "transformers_static")
    }
    brief["engine_other_prefill_caps"] = {
        cap: {k: round(v, 4) for k, v in data.items() if k != "ttft_all_s"}
        for cap, data in other_caps.items()
    }
    for name in ("engine", "transformers_static"):
        brief[name] = {k: round(v, 4) for k, v in result[name].items() if k != "ttft_all_s"}
    print(json.dumps(brief, indent=2))  # noqa: T201 - a script's report


if __name__ == "__main__":
    main()
