"""Constrained decoding on the torch_llm engine: its cost against free decoding on the same trace.

Model: the random-weight Llama of bench_lora (hidden 512, 8 layers, fp32) with a byte-level BPE
tokenizer of 32,000 tokens trained here on random words, so the grammar's token masks span a real
vocabulary size. Three measurements:

1. Decode throughput at 1 and 16 requests in flight (closed loop over the first `--requests` of
   the chat-mix trace, prompts from the trace). The constrained run samples at temperature 1.0
   under a JSON schema (`SCHEMA`: an extraction record with enums, a pattern, a format, number
   ranges, an array with item bounds, a `$ref`); the free run replays the same requests with each
   one's max_tokens set to the number of tokens its constrained answer took (ignore_eos), so both
   runs generate as many tokens in the same batches. A first constrained run warms up and is not
   counted; then `--rounds` free and constrained runs alternate (the median run of each is kept). Clock: this thread's CPU time (torch runs on
   this thread with one thread; the matchers fill their masks on it too). Target >= 0.9x.
2. Time to first token of a cached schema vs free text, through the backend (`generate()` on an
   event loop, the path a gateway request takes), alternated, medians. Target <= 5 ms added.
3. Loop-stall probe: while a free stream runs, new (uncached) large schemas compile on the grammar
   worker thread; a ticker on the event loop records how late its 5 ms sleeps wake, and the stream's
   inter-token gaps are recorded, during the compiles and during a baseline with no compile.

Writes bench/results/structured.json and structured.png.

    .venv/bin/python -m bench.bench_structured --requests 48
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import platform
import random
import statistics
import tempfile
import time
from typing import Any

import torch

from backends.base import GenerateRequest, SamplingParams, StructuredOutput
from backends.demo_models.tiny_llama import SPECIAL_TOKENS, write_tiny_llama
from backends.spec import DeploymentSpec
from backends.torch_llm.backend import create
from backends.torch_llm.factory import build_engine
from backends.torch_llm.options import LLMOptions
from backends.torch_llm.structured.compiler import GrammarCompiler
from bench.bench_llm_engine import TRACE, load_trace

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
VOCAB = 32000

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "format": "email"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "plan": {"enum": ["free", "pro", "enterprise"]},
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "email", "age", "score", "plan", "code", "tags", "active"],
    "additionalProperties": False,
    "$defs": {"tag": {"type": "string", "maxLength": 10}},
}


def structured(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput(json_schema=json.dumps(schema, sort_keys=True, separators=(",", ":")))


def big_schema(nonce: int, fields: int) -> dict[str, Any]:
    """A new (uncached) schema that takes a while to compile: many constrained fields."""
    props = {
        f"f{nonce}_{i}": [
            {"type": "string", "pattern": f"^[a-z]{{2,{4 + i % 7}}}-[0-9]{{{1 + i % 4}}}$"},
            {"enum": [f"v{nonce}_{i}_{j}" for j in range(12)]},
            {"type": "integer", "minimum": -i * 7, "maximum": i * 13 + nonce},
            {"type": "array", "items": {"type": "string", "maxLength": 5 + i % 9}, "maxItems": 3},
        ][i % 4]
        for i in range(fields)
    }
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def write_model(folder: pathlib.Path) -> pathlib.Path:
    """bench_lora's Llama with a 32k-token byte-level BPE trained on random words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    write_tiny_llama(
        folder, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8,
        intermediate_size=512 * 11 // 4, pad_vocab_to=VOCAB, max_position_embeddings=2048, seed=0,
    )  # fmt: skip
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789_-.,:{}[]\"' "
    corpus = [
        " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(12))
        for _ in range(60000)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    return folder


# --- 1. throughput --------------------------------------------------------------------------------


def run_engine(
    folder: pathlib.Path,
    reqs: list[dict],
    in_flight: int,
    so: StructuredOutput | None,
    lengths: list[int] | None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Closed loop: `in_flight` requests at a time; constrained when `so`, else free with `lengths`.
    Clock: this thread's CPU time on the CPU, wall time on CUDA (each step ends in a host copy)."""
    opts = LLMOptions(block_size=16, kv_cache_bytes=1 << 30, max_num_seqs=64, max_model_len=2048)
    parts = build_engine(folder, opts, device=device)
    clock = time.thread_time if device == "cpu" else time.perf_counter
    engine = parts.engine
    grammar = None
    if so is not None:
        compiler = GrammarCompiler(parts.tokenizer, parts.config.vocab_size, engine.config.eos_token_ids)
        compiler.warm()
        grammar = asyncio.run(compiler.get(so))
    out_len: dict[int, int] = {}
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    pending = list(range(len(reqs)))
    running = 0
    start = clock()
    while pending or engine.has_unfinished:
        while pending and running < in_flight:
            i = pending.pop(0)
            if so is not None:
                params = SamplingParams(max_tokens=reqs[i]["budget"], temperature=1.0, seed=i, structured=so)
            else:
                params = SamplingParams(max_tokens=lengths[i], temperature=1.0, seed=i, ignore_eos=True)  # type: ignore[index]
            engine.add_request(str(i), reqs[i]["prompt"], params, grammar=grammar)
            running += 1
        for o in engine.step():
            i = int(o.request_id)
            out_len[i] = out_len.get(i, 0) + len(o.token_ids)
            texts[i] = texts.get(i, "") + o.text
            if o.finish_reason is not None:
                reasons[i] = o.finish_reason
                running -= 1
    elapsed = clock() - start
    tokens = sum(out_len.values())
    valid = 0
    if so is not None:
        for i, reason in reasons.items():
            if reason == "stop":
                json.loads(texts[i])
                valid += 1
    return {
        "tokens": tokens, "cpu_s": elapsed, "tokens_per_s": tokens / elapsed,
        "lengths": [out_len[i] for i in range(len(reqs))], "stopped_and_parsed": valid,
    }  # fmt: skip


# --- 2 and 3: through the backend on an event loop ------------------------------------------------


async def backend_probes(
    folder: pathlib.Path, rounds: int, compiles: int, fields: int, device: str = "cpu"
) -> dict[str, Any]:
    backend = create("bench", DeploymentSpec(backend="torch_llm", model=str(folder), device=device))
    await backend.load()
    so = structured(SCHEMA)
    prompt = [0] + [random.Random(1).randrange(6, VOCAB) for _ in range(63)]

    async def first_token(i: int, constrained: bool) -> float:
        sampling = SamplingParams(max_tokens=2, temperature=1.0, seed=i, structured=so if constrained else None)
        request = GenerateRequest(request_id=f"t{i}-{constrained}", prompt_token_ids=prompt, sampling=sampling)
        started = time.perf_counter()
        stream = backend.generate(request)
        await anext(stream)
        took = time.perf_counter() - started
        await stream.aclose()
        return took

    await first_token(-1, True)  # compiles and caches the schema
    free, cached = [], []
    for i in range(rounds):
        free.append(await first_token(i, False))
        cached.append(await first_token(i, True))
    stall = await stall_probe(backend, prompt, compiles, fields)
    await backend.close()
    return {
        "ttft_free_ms_median": statistics.median(free) * 1e3,
        "ttft_cached_schema_ms_median": statistics.median(cached) * 1e3,
        "ttft_added_ms": (statistics.median(cached) - statistics.median(free)) * 1e3,
        "rounds": rounds,
        "stall": stall,
    }


async def stall_probe(backend: Any, prompt: list[int], compiles: int, fields: int) -> dict[str, Any]:
    """Loop lateness and a free stream's inter-token gaps, without and with new schemas compiling."""

    async def ticker(stop: asyncio.Event, late: list[float]) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            late.append(time.perf_counter() - t - 0.005)

    async def stream_gaps(rid: str, stop: asyncio.Event, gaps: list[float]) -> None:
        sampling = SamplingParams(max_tokens=100000, temperature=1.0, seed=1, ignore_eos=True)
        request = GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
        last = None
        async for _ in backend.generate(request):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            if stop.is_set():
                break

    async def phase(name: str, work: Any) -> dict[str, Any]:
        stop, late, gaps = asyncio.Event(), [], []
        tasks = [asyncio.create_task(ticker(stop, late)), asyncio.create_task(stream_gaps(name, stop, gaps))]
        await asyncio.sleep(0.5)  # the stream is running
        late.clear()
        gaps.clear()
        started = time.perf_counter()
        extra = await work()
        duration = time.perf_counter() - started
        stop.set()
        await asyncio.gather(*tasks)
        return {
            "seconds": duration, "loop_late_ms_max": max(late) * 1e3, "loop_late_ms_p99": _pct(late, 99) * 1e3,
            "itl_ms_median": statistics.median(gaps) * 1e3, "itl_ms_max": max(gaps) * 1e3, **extra,
        }  # fmt: skip

    grammars = backend._grammars  # noqa: SLF001 - the bench times the backend's own compiler

    async def compile_new() -> dict[str, Any]:
        times = []
        for nonce in range(compiles):
            t = time.perf_counter()
            await grammars.get(structured(big_schema(nonce, fields)))
            times.append(time.perf_counter() - t)
        return {"compile_s_median": statistics.median(times), "compiles": compiles}

    async def idle() -> dict[str, Any]:
        await asyncio.sleep(2.0)
        return {}

    return {"baseline": await phase("idle", idle), "compiling": await phase("compiling", compile_new)}


def _median(runs: list[dict[str, Any]]) -> float:
    return statistics.median(r["tokens_per_s"] for r in runs)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    from bench import plotting  # bench/plotting.py: the footer with the date and machine

    fig, (a, b, c) = plotting.figure(1, 3, size=(14, 4.5))
    groups = [f"{k} in flight" for k in result["throughput"]]
    plotting.grouped_bars(a, groups, {
        "free": [v["free"]["tokens_per_s"] for v in result["throughput"].values()],
        "JSON schema": [v["constrained"]["tokens_per_s"] for v in result["throughput"].values()],
    }, fmt="{:.0f}")  # fmt: skip
    a.set_title("decode tokens/s (CPU time): " + ", ".join(
        f"{k}: {v['ratio']:.2f}x" for k, v in result["throughput"].items()), fontsize=9)  # fmt: skip
    p = result["probes"]
    plotting.grouped_bars(b, ["time to first token"], {
        "free": [p["ttft_free_ms_median"]], "cached schema": [p["ttft_cached_schema_ms_median"]],
    }, fmt="{:.1f}")  # fmt: skip
    b.set_title(f"TTFT ms (median): cached schema adds {p['ttft_added_ms']:.2f} ms", fontsize=9)
    s = p["stall"]
    plotting.grouped_bars(c, ["loop late max", "stream ITL max"], {
        "no compile": [s["baseline"]["loop_late_ms_max"], s["baseline"]["itl_ms_max"]],
        "new schemas compiling": [s["compiling"]["loop_late_ms_max"], s["compiling"]["itl_ms_max"]],
    }, fmt="{:.1f}")  # fmt: skip
    c.set_title(f"ms; a new schema compiles in {s['compiling']['compile_s_median'] * 1e3:.0f} ms", fontsize=9)
    fig.suptitle(result["setup"]["summary"], fontsize=8)
    fig.tight_layout()
    plotting.save(fig, path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2, help="free/constrained pairs per concurrency")
    ap.add_argument("--ttft-rounds", type=int, default=30)
    ap.add_argument("--compiles", type=int, default=4)
    ap.add_argument("--fields", type=int, default=80)
    ap.add_argument("--trace", type=pathlib.Path, default=TRACE)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (a lent GPU machine: bench/gpu_checks.sh)")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "structured.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    so = structured(SCHEMA)
    throughput: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_model(pathlib.Path(tmp) / "m")
        reqs = load_trace(args.trace, args.requests, 1.0, args.max_prompt, args.max_output, VOCAB)
        for r in reqs:
            r["budget"] = args.max_output  # room for the whole record; the schema ends it
        for k in (1, 16):
            batch = reqs[: max(16, args.requests // (4 if k == 1 else 1))]
            # a first constrained run warms the process (kernel builds, allocator) and fixes each
            # request's length (seeded: every later constrained run makes the same tokens); then
            # free and constrained alternate, medians kept
            lengths = run_engine(folder, batch, k, so, None, args.device)["lengths"]
            runs: dict[str, list[dict[str, Any]]] = {"free": [], "constrained": []}
            for _ in range(args.rounds):
                runs["free"].append(run_engine(folder, batch, k, None, lengths, args.device))
                runs["constrained"].append(run_engine(folder, batch, k, so, None, args.device))
            free, constrained = (min(rs, key=lambda r: abs(r["tokens_per_s"] - _median(rs))) for rs in runs.values())
            throughput[str(k)] = {
                "requests": len(batch), "rounds": args.rounds, "free": free, "constrained": constrained,
                "ratio": constrained["tokens_per_s"] / free["tokens_per_s"],
                "ratios_by_round": [c["tokens_per_s"] / f["tokens_per_s"] for f, c in zip(*runs.values(), strict=True)],
            }  # fmt: skip
            print(f"{k:>2} in flight: free {free['tokens_per_s']:.1f} tok/s, schema "
                  f"{constrained['tokens_per_s']:.1f} tok/s, {throughput[str(k)]['ratio']:.3f}x", flush=True)  # fmt: skip
        probes = asyncio.run(backend_probes(folder, args.ttft_rounds, args.compiles, args.fields, args.device))
    result = {
        "setup": {
            "summary": (
                f"Llama h512 L8, 32k-token BPE, {_device(args.device)}; chat-mix prompts, JSON schema at "
                f"temperature 1.0 vs free decoding of the same lengths; xgrammar {_version('xgrammar')}"
            ),
            "schema": SCHEMA, "device": args.device,
            "clock": ("thread CPU time" if args.device == "cpu" else "wall") + " (throughput); wall (probes)",
            "machine": {"cpu": platform.processor() or platform.machine(), "torch_threads": 1},
        },
        "throughput": throughput,
        "probes": probes,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in probes.items()}, indent=1))


def _device(device: str) -> str:
    if device == "cpu":
        return "fp32 CPU 1 thread"
    return f"{torch.cuda.get_device_name(0)} (dtype auto)"


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
