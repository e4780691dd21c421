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
import contextlib
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
from collections.abc import Iterator
from typing import Any

import httpx

from backends.demo_models.tiny_llama import write_tiny_llama
from backends.openvino_llm.export import export_llm
from bench.servers import ROOT, free_port, stop, wait_ready

TRACE = ROOT.parent / "shared" / "workloads" / "chat-mix.jsonl"
RESULTS = ROOT / "bench" / "results"
ADMIN_KEY = "bench-openvino-llm-admin"
#: `bench` runs the throughput replays; the quiet ones and `noisy` the flood
TENANTS = ("bench", "quiet-a", "quiet-b", "quiet-c", "noisy", "noisy-capped")
#: `noisy-capped` may hold half the engine's 16 slots (a per-tenant concurrency limit)
_TENANT_SPECS = {"noisy-capped": "{limits: {max_concurrency: 8}}"}
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


def direct_pipeline(folder: pathlib.Path, trace: list[dict[str, Any]], threads: int) -> Any:
    """The bare pipeline (same export and options as the gateway's), warmed like the gateway."""
    import openvino_genai as ov_genai

    from backends.openvino_llm.options import parse_options

    o = parse_options(options(threads))
    sched = ov_genai.SchedulerConfig()
    sched.num_kv_blocks, sched.max_num_seqs = o.num_kv_blocks, o.max_num_seqs
    sched.max_num_batched_tokens, sched.enable_prefix_caching = o.max_num_batched_tokens, o.enable_prefix_caching
    sched.dynamic_split_fuse = o.dynamic_split_fuse
    pipe = ov_genai.ContinuousBatchingPipeline(str(folder), sched, "CPU", o.properties())
    _closed_loop(pipe, trace[:4], 2, 1 << 30)  # warm: first compilations and allocations
    return pipe


_REQUEST_IDS = iter(range(1 << 40))


def _closed_loop(pipe: Any, trace: list[dict[str, Any]], in_flight: int, first_id: int = 0) -> dict[str, float]:
    """Keep `in_flight` requests added, step, read, until the trace is served."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    pending = [(first_id + next(_REQUEST_IDS), r) for r in trace]
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
        f"tenants: {{{', '.join(f'{t}: ' + _TENANT_SPECS.get(t, '{}') for t in TENANTS)}}}\n"
        f"deployments:\n  llm: {deployment}\nmodels:\n  m: {{routes: [{{deployment: llm}}]}}\n"
    )
    return path


async def _client_run(
    url: str, key: str, trace: list[dict[str, Any]], in_flight: int, stream: bool = True
) -> dict[str, Any]:
    """Closed loop over HTTP. `stream=False` asks for whole answers: the client then costs nothing
    per token, so on a 2-core box its CPU does not count against the gateway."""
    queue = list(trace)
    ttft: list[float] = []
    itl: list[float] = []  # per request: (last token - first token) / (tokens - 1)
    tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            r = queue.pop(0)
            body = {"model": "m", "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0,
                    "ignore_eos": True, "stream": stream}  # fmt: skip
            if stream:
                body["stream_options"] = {"include_usage": True}
            sent = time.perf_counter()
            if not stream:
                resp = await client.post(f"{url}/v1/completions", json=body)
                if resp.status_code == 429:  # a tenant at its concurrency limit: try again shortly
                    await asyncio.sleep(0.02)
                    continue
                resp.raise_for_status()
                tokens += resp.json()["usage"]["completion_tokens"]
                continue
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
        "ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else 0.0, "ttft_p99_ms": 1000 * _pct(ttft, 0.99),
        "ttft_s": ttft,
        "itl_p50_ms": 1000 * statistics.median(itl) if itl else 0.0, "itl_p99_ms": 1000 * _pct(itl, 0.99),
    }  # fmt: skip


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def gateway(deployment: str, work: pathlib.Path, trace: list[dict[str, Any]]) -> Iterator[tuple[str, str, int]]:
    """A `fleetgate serve` subprocess with one deployment, warmed: (url, the bench tenant's key, pid)."""
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
        yield url, key, proc.pid
    finally:
        stop(proc)


def whole(url: str, key: str, trace: list[dict[str, Any]], c: int) -> dict[str, Any]:
    return asyncio.run(_client_run(url, key, trace, c, stream=False))


def streamed(url: str, key: str, trace: list[dict[str, Any]], c: int) -> dict[str, Any]:
    run = asyncio.run(_client_run(url, key, trace, c))
    run.pop("ttft_s")
    return run


def _key(url: str, tenant: str) -> str:
    r = httpx.post(f"{url}/admin/keys", json={"tenant": tenant}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    r.raise_for_status()
    return str(r.json()["key"])


def _noise(url: str, key: str, trace: list[dict[str, Any]], done: Any) -> None:
    """In its own process: `noisy` keeps 32 whole-answer requests in flight until `done` is set."""
    while not done.is_set():
        asyncio.run(_client_run(url, key, trace, 32, stream=False))


def flood(url: str, trace: list[dict[str, Any]], noisy: str = "noisy") -> dict[str, Any]:
    """The quiet tenants' TTFT p99 (streamed, one request in flight each), alone and beside `noisy`."""
    import multiprocessing

    keys = {t: _key(url, t) for t in TENANTS[1:]}
    quiet = [t for t in keys if t.startswith("quiet")]

    async def quiet_run() -> list[float]:
        runs = await asyncio.gather(*(_client_run(url, keys[t], trace[:12], 1) for t in quiet))
        return [x for r in runs for x in r["ttft_s"]]

    solo = asyncio.run(quiet_run())
    ctx = multiprocessing.get_context("spawn")
    done = ctx.Event()
    noise = ctx.Process(target=_noise, args=(url, keys[noisy], trace, done))
    noise.start()
    try:
        time.sleep(3.0)  # the noisy backlog builds up first
        flooded = asyncio.run(quiet_run())
    finally:
        done.set()
        noise.join(timeout=120)
        if noise.is_alive():
            noise.terminate()
    solo_p99, flood_p99 = 1000 * _pct(solo, 0.99), 1000 * _pct(flooded, 0.99)
    return {"quiet_ttft_p99_solo_ms": round(solo_p99, 1), "quiet_ttft_p99_flood_ms": round(flood_p99, 1),
            "quiet_ttft_p50_solo_ms": round(1000 * statistics.median(solo), 1),
            "quiet_ttft_p50_flood_ms": round(1000 * statistics.median(flooded), 1),
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
    cs = [str(c) for c in result["in_flight"]]
    plotting.grouped_bars(tax, [f"{c} in flight" for c in cs], {
        "pipeline direct": [result["tax"]["direct_tokens_per_s"][c] for c in cs],
        "through fleetgate": [result["tax"]["gateway_tokens_per_s"][c] for c in cs],
    })  # fmt: skip
    tax.set_title("openvino_llm fp32, output tokens/s (medians of rounds)")
    names = list(result["pick"])
    plotting.grouped_bars(pick, [n.replace("openvino_llm ", "ov ") for n in names], {
        "tokens/s": [result["pick"][n]["tokens_per_s"] for n in names],
        "ITL p50 ms": [result["pick"][n]["itl_p50_ms"] for n in names],
        "peak RSS MiB / 10": [result["pick"][n]["peak_rss_mib"] / 10 for n in names],
    }, fmt="{:.1f}")  # fmt: skip
    pick.set_title(f"which to pick at {max(result['in_flight'])} in flight")
    plotting.save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-output", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=2)
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
        tax, flooded = no_tax(exports["fp32"], work, trace, in_flight, args.rounds, args.threads)
        pick = which_to_pick(exports, src, work, trace, args.rounds, args.threads)
        agree = agreement(exports, [r["prompt"] for r in trace[:8]], 32, args.threads)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "threads": args.threads,
                    "load_average": os.getloadavg()},  # fmt: skip
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": VOCAB},
        "trace": {"requests": args.requests, "max_prompt": args.max_prompt, "max_output": args.max_output,
                  "rounds": args.rounds},  # fmt: skip
        "in_flight": in_flight,
        "tax": tax,
        "pick": pick,
        "agreement": agree,
        "flood": flooded,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({"tax": tax["ratio"], "backend_in_process": tax["backend_in_process_ratio"], "agreement": agree, "flood": flooded, "pick": pick}, indent=2))


def no_tax(
    folder: pathlib.Path, work: pathlib.Path, trace: list[dict[str, Any]], in_flight: list[int], rounds: int, threads: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Whole answers through the gateway against the bare pipeline, interleaved round by round; then
    streamed runs for TTFT and ITL, and the flood."""
    pipe = direct_pipeline(folder, trace, threads)
    direct: dict[str, list[float]] = {str(c): [] for c in in_flight}
    through: dict[str, list[float]] = {str(c): [] for c in in_flight}
    backend: dict[str, list[float]] = {str(c): [] for c in in_flight}
    for _ in range(rounds):  # the backend in this process, no HTTP: what the adapter itself costs
        for c in in_flight:
            direct[str(c)].append(_closed_loop(pipe, trace, c)["tokens_per_s"])
            backend[str(c)].append(asyncio.run(_backend_run(folder, trace, c, threads)))
    deployment = f"{{backend: openvino_llm, model: {folder}, device: CPU, options: {json.dumps(options(threads))}}}"
    with gateway(deployment, work, trace) as (url, key, _):
        for _ in range(rounds):
            for c in in_flight:
                direct[str(c)].append(_closed_loop(pipe, trace, c)["tokens_per_s"])
                through[str(c)].append(whole(url, key, trace, c)["tokens_per_s"])
        streams = {str(c): streamed(url, key, trace, c) for c in in_flight}
        flooded = {"fair_queue_only": flood(url, trace), "noisy_limited_to_8_of_16_slots": flood(url, trace, "noisy-capped")}
    # rounds 1..n of `direct` pair with the in-process backend, rounds n+1..2n with the gateway
    ratio = {c: round(statistics.median(g / d for g, d in zip(through[c], direct[c][rounds:], strict=True)), 3)
             for c in direct}  # fmt: skip
    in_process = {c: round(statistics.median(b / d for b, d in zip(backend[c], direct[c][:rounds], strict=True)), 3)
                  for c in direct}  # fmt: skip
    return {
        "backend_in_process_ratio": in_process,
        "backend_in_process_tokens_per_s": {c: round(statistics.median(v), 1) for c, v in backend.items()},
        "direct_tokens_per_s": {c: round(statistics.median(v), 1) for c, v in direct.items()},
        "gateway_tokens_per_s": {c: round(statistics.median(v), 1) for c, v in through.items()},
        "ratio": ratio, "rounds": {"direct": direct, "gateway": through, "backend": backend}, "streamed": streams,
    }, flooded  # fmt: skip


async def _backend_run(folder: pathlib.Path, trace: list[dict[str, Any]], in_flight: int, threads: int) -> float:
    """Output tokens/s of the `openvino_llm` backend driven in this process (no HTTP, no gateway)."""
    from backends.base import GenerateRequest, SamplingParams
    from backends.openvino_llm.backend import create
    from backends.spec import DeploymentSpec

    backend = create("bench", DeploymentSpec(backend="openvino_llm", model=str(folder), options=options(threads)))
    await backend.load()
    await backend.warmup()
    pending = list(enumerate(trace))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while pending:
            i, r = pending.pop(0)
            sampling = SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
            request = GenerateRequest(request_id=f"r{i}", prompt_token_ids=r["prompt"], sampling=sampling, stream=False)
            async for event in backend.generate(request):
                tokens += len(event.token_ids)

    try:
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(in_flight)))
        return tokens / (time.perf_counter() - started)
    finally:
        await backend.close()


def which_to_pick(
    exports: dict[str, pathlib.Path], src: pathlib.Path, work: pathlib.Path, trace: list[dict[str, Any]],
    rounds: int, threads: int,
) -> dict[str, Any]:  # fmt: skip
    """torch_llm and the three exports, each behind its own gateway, all up at once and measured in
    interleaved rounds at 16 in flight (whole answers for tokens/s, one streamed run for ITL/TTFT)."""
    deployments = {f"openvino_llm {w}": f"{{backend: openvino_llm, model: {f}, device: CPU, "
                   f"options: {json.dumps(options(threads))}}}" for w, f in exports.items()}  # fmt: skip
    torch_opts = json.dumps({"max_num_seqs": 16, "kv_cache_bytes": 1 << 28})
    deployments["torch_llm"] = f"{{backend: torch_llm, model: {src}, device: cpu, options: {torch_opts}}}"
    with contextlib.ExitStack() as stack:
        up = {name: stack.enter_context(gateway(dep, work, trace)) for name, dep in deployments.items()}
        rates: dict[str, list[float]] = {name: [] for name in up}
        for _ in range(rounds):
            for name, (url, key, _pid) in up.items():
                rates[name].append(whole(url, key, trace, 16)["tokens_per_s"])
        out = {}
        for name, (url, key, pid) in up.items():
            s = streamed(url, key, trace, 16)
            out[name] = {"tokens_per_s": round(statistics.median(rates[name]), 1), "rounds": rates[name],
                         "itl_p50_ms": round(s["itl_p50_ms"], 2), "ttft_p50_ms": round(s["ttft_p50_ms"], 1),
                         "streamed_tokens_per_s": round(s["tokens_per_s"], 1), "peak_rss_mib": _peak_rss_mib(pid)}  # fmt: skip
        return out


if __name__ == "__main__":
    main()
