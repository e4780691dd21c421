"""openvino_llm: what fleetgate costs over the pipeline itself, and which engine to pick on Intel CPUs.

One run, on one tiny-ish random-weight Llama (written here) and one trace (the first requests of
../shared/workloads/chat-mix.jsonl, prompts and outputs capped), replayed closed-loop at a fixed
number in flight, every output exactly `max_tokens` long (ignore_eos):

1. **No tax**: output tokens/s through a `fleetgate serve` subprocess (streamed completions over HTTP)
   over the same ContinuousBatchingPipeline called directly in this process (same export, same
   options), at 1 and 16 in flight. Target >= 0.9x. TTFT and ITL as the client sees them.
2. **Which to pick**: torch_llm vs openvino_llm with fp32, int8 and int4 exports through the gateway
   at 16 in flight: output tokens/s, ITL p50 and the gateway's peak resident memory (VmHWM).
3. **Agreement**: greedy tokens of the int8 and int4 exports against fp32 (same prompts), and the
   perplexity change on a fixed text.

Writes bench/results/openvino_llm.json and openvino_llm.png. Ratios are taken inside this one run
(the machines are shared and noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from backends.demo_models.tiny_llama import write_tiny_llama
from backends.openvino_llm.export import export_llm
from bench.servers import ROOT, free_port, stop, wait_ready

TRACE = ROOT.parent / "shared" / "workloads" / "chat-mix.jsonl"
RESULTS = ROOT / "bench" / "results"
ADMIN_KEY = "bench-openvino-llm-admin"
#: `bench` runs the throughput replays; the quiet ones and `noisy` the flood
TENANTS = ("bench", "quiet-a", "quiet-b", "quiet-c", "noisy")
VOCAB = 8192


def load_trace(n: int, max_prompt: int, max_out: int) -> list[dict[str, Any]]:
    """The first `n` requests: prompt ids drawn from each request's seed, lengths capped."""
    out = []
    for line in TRACE.read_text().splitlines()[:n]:
        r = json.loads(line)
        rng = random.Random(r["seed"])
        plen = max(2, min(r["prompt_tokens"], max_prompt))
        out.append({"prompt": [0] + [rng.randrange(6, 500) for _ in range(plen - 1)],
                    "max_tokens": max(1, min(r["max_tokens"], max_out))})  # fmt: skip
    return out


def options(threads: int) -> dict[str, Any]:
    return {"num_kv_blocks": 2048, "max_num_seqs": 16, "max_num_batched_tokens": 1024, "threads": threads}


# --- the pipeline called directly ----------------------------------------------------------------


def run_direct(folder: pathlib.Path, trace: list[dict[str, Any]], in_flights: list[int], threads: int) -> dict[str, Any]:
    """The bare pipeline (same export and options as the gateway's), warmed like the gateway."""
    import openvino_genai as ov_genai

    from backends.openvino_llm.options import parse_options

    o = parse_options(options(threads))
    sched = ov_genai.SchedulerConfig()
    sched.num_kv_blocks, sched.max_num_seqs = o.num_kv_blocks, o.max_num_seqs
    sched.max_num_batched_tokens, sched.enable_prefix_caching = o.max_num_batched_tokens, o.enable_prefix_caching
    sched.dynamic_split_fuse = o.dynamic_split_fuse
    pipe = ov_genai.ContinuousBatchingPipeline(str(folder), sched, "CPU", o.properties())
    _closed_loop(pipe, trace[:4], 2, 10_000)  # warm: first compilations and allocations
    return {str(c): _closed_loop(pipe, trace, c, 0) for c in in_flights}


def _closed_loop(pipe: Any, trace: list[dict[str, Any]], in_flight: int, first_id: int) -> dict[str, float]:
    """Keep `in_flight` requests added, step, read, until the trace is served."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    pending = [(first_id + i, r) for i, r in enumerate(trace)]
    live: dict[int, Any] = {}
    tokens = 0
    started = time.perf_counter()
    while pending or live:
        while pending and len(live) < in_flight:
            i, r = pending.pop(0)
            config = ov_genai.GenerationConfig()
            config.max_new_tokens, config.ignore_eos, config.do_sample = r["max_tokens"], True, False
            live[i] = pipe.add_request(i, ov.Tensor(np.asarray([r["prompt"]], dtype=np.int64)), config)
        pipe.step()
        for i, handle in list(live.items()):
            if handle.can_read():
                tokens += sum(len(o.generated_ids) for o in handle.read().values())
            if handle.get_status() != ov_genai.GenerationStatus.RUNNING and not handle.can_read():
                del live[i]
    wall = time.perf_counter() - started
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


# --- through the gateway -------------------------------------------------------------------------


def gateway_config(deployment: str, work: pathlib.Path) -> pathlib.Path:
    path = work / f"{abs(hash(deployment))}.yaml"
    path.write_text(
        f"state: {{url: 'memory://'}}\nadmin: {{key_env: FLEETGATE_ADMIN_KEY}}\n"
        f"tenants: {{{', '.join(f'{t}: {{}}' for t in TENANTS)}}}\n"
        f"deployments:\n  llm: {deployment}\nmodels:\n  m: {{routes: [{{deployment: llm}}]}}\n"
    )
    return path


async def _client_run(url: str, key: str, trace: list[dict[str, Any]], in_flight: int) -> dict[str, Any]:
    queue = list(trace)
    ttft: list[float] = []
    itl: list[float] = []  # per request: (last token - first token) / (tokens - 1)
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            r = queue.pop(0)
            body = {"model": "m", "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            sent = time.perf_counter()
            first = last = None
            async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    now = time.perf_counter()
                    if chunk.get("usage"):
                        tokens += chunk["usage"]["completion_tokens"]
                    if chunk.get("choices"):
                        if first is None:
                            first = now
                            ttft.append(now - sent)
                        last = now
            if first is not None and last is not None and r["max_tokens"] > 1:
                # the request's mean gap between tokens (vLLM's TPOT): chunks read in one burst
                # make gaps between single chunks meaningless
                itl.append((last - first) / (r["max_tokens"] - 1))

    started = time.perf_counter()
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(in_flight)))
    wall = time.perf_counter() - started
    return {
        "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttft), "ttft_p99_ms": 1000 * _pct(ttft, 0.99), "ttft_s": ttft,
        "itl_p50_ms": 1000 * statistics.median(itl) if itl else 0.0, "itl_p99_ms": 1000 * _pct(itl, 0.99),
    }  # fmt: skip


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_gateway(
    deployment: str, work: pathlib.Path, trace: list[dict[str, Any]], in_flights: list[int], flood: bool = False
) -> dict[str, Any]:
    """Start `fleetgate serve` with one deployment, replay the trace at each concurrency, read its peak RSS."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / f"gateway-{port}.log"
    env = {**os.environ, "FLEETGATE_ADMIN_KEY": ADMIN_KEY}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.serve.cli", "serve", "--config", str(gateway_config(deployment, work)),
             "--port", str(port)],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_ready(proc, f"{url}/health/ready", log, timeout_s=300)
        key = _key(url, "bench")
        asyncio.run(_client_run(url, key, trace[:4], 2))  # warm: first compilations and allocations
        runs: dict[str, Any] = {str(c): asyncio.run(_client_run(url, key, trace, c)) for c in in_flights}
        for c in in_flights:
            runs[str(c)].pop("ttft_s")
        runs["peak_rss_mib"] = _peak_rss_mib(proc.pid)
        if flood:
            keys = {t: _key(url, t) for t in TENANTS[1:]}
            runs["flood"] = asyncio.run(_flood(url, keys, trace))
        return runs
    finally:
        stop(proc)


def _key(url: str, tenant: str) -> str:
    r = httpx.post(f"{url}/admin/keys", json={"tenant": tenant}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    r.raise_for_status()
    return str(r.json()["key"])


async def _flood(url: str, keys: dict[str, str], trace: list[dict[str, Any]]) -> dict[str, Any]:
    """The quiet tenants' TTFT p99, alone and beside `noisy` keeping 32 requests in flight."""
    quiet = [t for t in keys if t != "noisy"]

    async def quiet_run() -> list[float]:
        runs = await asyncio.gather(*(_client_run(url, keys[t], trace[:12], 1) for t in quiet))
        return [x for r in runs for x in r["ttft_s"]]

    solo = await quiet_run()
    stop_noise = asyncio.Event()

    async def noise() -> None:
        while not stop_noise.is_set():
            await _client_run(url, keys["noisy"], trace, 32)

    task = asyncio.create_task(noise())
    await asyncio.sleep(2.0)  # the noisy backlog builds up first
    flooded = await quiet_run()
    stop_noise.set()
    await task
    solo_p99, flood_p99 = 1000 * _pct(solo, 0.99), 1000 * _pct(flooded, 0.99)
    return {"quiet_ttft_p99_solo_ms": solo_p99, "quiet_ttft_p99_flood_ms": flood_p99,
            "ratio": round(flood_p99 / solo_p99, 3)}  # fmt: skip


def _peak_rss_mib(pid: int) -> float:
    """VmHWM of the gateway and its children (workers), MiB."""
    total = 0.0
    pids = [pid] + [int(p) for p in _children(pid)]
    for p in pids:
        try:
            for line in pathlib.Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return round(total, 1)


def _children(pid: int) -> list[str]:
    try:
        return pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []


# --- agreement of compressed exports ---------------------------------------------------------------


def agreement(folders: dict[str, pathlib.Path], prompts: list[list[int]], tokens: int, threads: int) -> dict[str, Any]:
    """Greedy agreement with fp32 (share of tokens before the first difference, averaged over the
    prompts) and the perplexity of each export on one fixed token sequence."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    from backends.openvino_llm.options import parse_options

    o = parse_options(options(threads))
    outputs: dict[str, list[list[int]]] = {}
    text = [0] + [random.Random(5).randrange(6, 500) for _ in range(127)]
    ppl = {name: _perplexity(folder / "openvino_model.xml", text, threads) for name, folder in folders.items()}
    for name, folder in folders.items():
        sched = ov_genai.SchedulerConfig()
        sched.num_kv_blocks = 512
        pipe = ov_genai.ContinuousBatchingPipeline(str(folder), sched, "CPU", o.properties())
        config = ov_genai.GenerationConfig()
        config.max_new_tokens, config.ignore_eos, config.do_sample = tokens, True, False
        handles = [pipe.add_request(i, ov.Tensor(np.asarray([p], dtype=np.int64)), config) for i, p in enumerate(prompts)]
        while pipe.has_non_finished_requests():
            pipe.step()
        outputs[name] = [list(h.read_all()[0].generated_ids) for h in handles]
    base = outputs["fp32"]
    out: dict[str, Any] = {}
    for name, runs in outputs.items():
        prefix = [next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), len(x)) / max(1, len(x))
                  for x, y in zip(runs, base, strict=True)]  # fmt: skip
        same = statistics.mean(sum(a == b for a, b in zip(x, y, strict=False)) / max(1, len(x)) for x, y in zip(runs, base, strict=True))
        out[name] = {"greedy_prefix_agreement": round(statistics.mean(prefix), 3), "greedy_token_agreement": round(same, 3),
                     "perplexity": round(ppl[name], 3), "perplexity_change": round(ppl[name] / ppl["fp32"] - 1, 4)}  # fmt: skip
    return out


def _perplexity(model_xml: pathlib.Path, text: list[int], threads: int) -> float:
    """exp(mean NLL) of `text[k+1]` given `text[:k+1]`, from one forward pass of the export's IR
    (the stateful model, before the pipeline's paged-attention rewrite), in f32."""
    import numpy as np
    import openvino as ov

    core = ov.Core()
    compiled = core.compile_model(str(model_xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32", "INFERENCE_NUM_THREADS": threads})
    request = compiled.create_infer_request()
    request.reset_state()
    ids = np.asarray([text], dtype=np.int64)
    logits = request.infer({"input_ids": ids, "position_ids": np.arange(len(text), dtype=np.int64)[None],
                            "beam_idx": np.zeros(1, dtype=np.int32)})["logits"][0]  # fmt: skip  # [T, V]
    logits = logits.astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz[:-1] - logits[np.arange(len(text) - 1), ids[0, 1:]]
    return float(math.exp(nll.mean()))


# --- the run ---------------------------------------------------------------------------------------


def plot(result: dict[str, Any], path: pathlib.Path) -> None:
    from bench import plotting  # the footer with the date and machine

    fig, (tax, pick) = plotting.figure(1, 2, (12, 4.5))
    groups = [f"{c} in flight" for c in result["in_flight"]]
    plotting.grouped_bars(tax, groups, {
        "pipeline direct": [result["tax"]["direct"][str(c)]["tokens_per_s"] for c in result["in_flight"]],
        "through fleetgate": [result["tax"]["gateway"][str(c)]["tokens_per_s"] for c in result["in_flight"]],
    })  # fmt: skip
    tax.set_title("openvino_llm fp32: output tokens/s, fleetgate over the bare pipeline")
    names = list(result["pick"])
    c = str(max(result["in_flight"]))
    plotting.grouped_bars(pick, names, {"tokens/s": [result["pick"][n][c]["tokens_per_s"] for n in names],
                                        "peak RSS MiB / 10": [result["pick"][n]["peak_rss_mib"] / 10 for n in names]})  # fmt: skip
    pick.set_title(f"which to pick at {c} in flight (ITL p50 in the JSON)")
    plotting.save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=48)
    ap.add_argument("--threads", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS / "openvino_llm.json")
    args = ap.parse_args()
    in_flight = [1, 16]
    trace = load_trace(args.requests, args.max_prompt, args.max_output)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        src = write_tiny_llama(work / "hf", hidden_size=args.hidden, num_layers=args.layers, num_heads=8,
                               num_kv_heads=4, pad_vocab_to=VOCAB, init_std=0.05, seed=3)  # fmt: skip
        exports: dict[str, pathlib.Path] = {}
        for w in ("fp32", "int8", "int4"):
            export_llm(src, work / w, w)
            exports[w] = work / w
        ov_dep = "{{backend: openvino_llm, model: {}, device: CPU, options: {}}}"
        opts = json.dumps(options(args.threads))
        direct = run_direct(exports["fp32"], trace, in_flight, args.threads)
        gateway = run_gateway(ov_dep.format(exports["fp32"], opts), work, trace, in_flight, flood=True)
        pick: dict[str, Any] = {"openvino_llm fp32": gateway}
        for w in ("int8", "int4"):
            pick[f"openvino_llm {w}"] = run_gateway(ov_dep.format(exports[w], opts), work, trace, [16])
        torch_opts = json.dumps({"max_num_seqs": 16, "kv_cache_bytes": 1 << 28})
        pick["torch_llm"] = run_gateway(f"{{backend: torch_llm, model: {src}, device: cpu, options: {torch_opts}}}",
                                        work, trace, [16])  # fmt: skip
        agree = agreement(exports, [r["prompt"] for r in trace[:8]], 32, args.threads)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": args.threads},
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": VOCAB},
        "trace": {"requests": args.requests, "max_prompt": args.max_prompt, "max_output": args.max_output},
        "in_flight": in_flight,
        "tax": {"direct": direct, "gateway": {str(c): gateway[str(c)] for c in in_flight},
                "ratio": {str(c): round(gateway[str(c)]["tokens_per_s"] / direct[str(c)]["tokens_per_s"], 3)
                          for c in in_flight}},  # fmt: skip
        "pick": pick,
        "agreement": agree,
        "flood": gateway.pop("flood"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({"ratio": result["tax"]["ratio"], "agreement": agree, "flood": result["flood"],
                      "pick": {n: {"tokens_per_s": round(v["16"]["tokens_per_s"], 1), "itl_p50_ms": round(v["16"]["itl_p50_ms"], 2),
                                   "peak_rss_mib": v["peak_rss_mib"]} for n, v in pick.items()}}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
