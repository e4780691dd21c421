"""Fair-queue benchmark for text generation: chat-mix through the gateway to the torch_llm engine.

Replays `../shared/workloads/chat-mix.jsonl` open-loop (t x `--time-scale`) as OpenAI
`/v1/completions` requests (prompt as token ids drawn from the request's seed, greedy,
`ignore_eos`, so every request produces exactly `max_tokens`) to a `fleetgate serve` with one
`torch_llm` deployment per policy (a small random-weight Llama from `write_tiny_llama`, one torch
thread, `max_num_seqs` sequences). Service is VTC's: input tokens + 2 x output tokens. The gateway
gates each queue on the engine's free sequence slots and charges output tokens as they are made.

Runs per round: the trace without `noisy` (`noflood`, FCFS), then FCFS, VTC and VTC with a burst
credit on the full trace. Reports per tenant p50/p99 latency and throughput (service units/s), Jain
per 1 s window and total throughput against FCFS, as bench/results/fairness_llm.json and .png.

    .venv/bin/python -m bench.bench_fairness_llm [--rounds 1] [--until 45] [--time-scale 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

import msgspec
import structlog

from bench.bench_fairness import Record, compare, median_summary, plot, summarize_run
from bench.bench_fairness_gateway import Client, create_keys, thread_cpu_s
from bench.bench_gateway import start_gateway

ROOT = Path(__file__).resolve().parents[1]

log = structlog.get_logger("bench_fairness_llm")

TRACE = ROOT.parent / "shared" / "workloads" / "chat-mix.jsonl"
RESULTS = ROOT / "bench" / "results"
QUIET = ("alpha", "beta", "gamma")
NOISY = "noisy"
POLICIES = ("fcfs", "vtc", "vtc_burst")


class ChatRequest(msgspec.Struct):
    t: float
    tenant: str
    prompt_tokens: int
    max_tokens: int
    seed: int

    @property
    def service(self) -> int:
        return self.prompt_tokens + 2 * self.max_tokens


def gateway_config(port: int, model: Path, args: argparse.Namespace) -> str:
    deployments, models = [], []
    for name in POLICIES:
        policy = "vtc" if name == "vtc_burst" else name
        burst = args.vtc_burst if name == "vtc_burst" else 0.0
        deployments.append(
            f"  dep-{name}: {{backend: torch_llm, model: {model}, device: cpu, "
            f"options: {{max_num_seqs: {args.seqs}, num_threads: 1, kv_cache_bytes: {64 << 20}}}, "
            f"queue: {{policy: {policy}, max_concurrency: {args.seqs}, vtc_burst: {burst}, "
            f"max_queue_per_tenant: 256}}}}"
        )
        models.append(f"  m-{name}: {{routes: [{{deployment: dep-{name}}}]}}")
    tenants = ", ".join(f"{t}: {{}}" for t in (*QUIET, NOISY))
    return (
        f"server: {{port: {port}, log_level: warning, request_timeout_s: 600}}\n"
        'state: {url: "memory://"}\n'
        f"tenants: {{bench: {{}}, {tenants}}}\n"
        "deployments:\n" + "\n".join(deployments) + "\nmodels:\n" + "\n".join(models) + "\n"
    )


def completion_request(port: int, key: str, model: str, req: ChatRequest, vocab: int) -> bytes:
    rng = random.Random(req.seed)
    body = msgspec.json.encode(
        {
            "model": model,
            "prompt": [rng.randrange(3, vocab) for _ in range(req.prompt_tokens)],
            "max_tokens": req.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


async def replay(
    client: Client, model: str, trace: list[ChatRequest], scale: float, vocab: int
) -> list[Record]:
    """Open loop; a record's `rows` is the request's service (input + 2 x output tokens)."""
    bodies = [completion_request(client.port, client.keys[r.tenant], model, r, vocab) for r in trace]
    records: list[Record] = []
    t0 = time.monotonic() + 0.2

    async def one(req: ChatRequest, body: bytes, due: float) -> None:
        status, answer = await client.exchange(body)
        done = time.monotonic()
        ok = status == 200
        if ok:
            usage = msgspec.json.decode(answer)["usage"]
            ok = usage["completion_tokens"] == req.max_tokens
        records.append(
            Record(
                tenant=req.tenant,
                rows=req.service,
                arrival=due - t0,
                dispatched=None,
                done=done - t0,
                status="ok" if ok else str(status),
            )
        )

    tasks = []
    for req, body in zip(trace, bodies, strict=True):
        due = t0 + req.t * scale
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, body, due)))
    await asyncio.gather(*tasks)
    client.close()
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--until", type=float, default=45.0, help="replay only t < UNTIL (trace seconds)")
    parser.add_argument("--seqs", type=int, default=4, help="engine max_num_seqs = queue max_concurrency")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192, help="model vocabulary (LM-head cost)")
    parser.add_argument("--vtc-burst", type=float, default=512.0, help="tokens of burst credit")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--window",
        type=float,
        default=5.0,
        help="Jain window (s): a request's service counts when it completes, and a generation "
        "lasts seconds, so 1 s windows would measure completion lumpiness, not fairness",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "fairness_llm")
    args = parser.parse_args()

    decoder = msgspec.json.Decoder(ChatRequest)
    trace = [decoder.decode(line) for line in args.trace.read_bytes().splitlines() if line.strip()]
    trace = [r for r in trace if r.t < args.until]
    noisy_t = [r.t * args.time_scale for r in trace if r.tenant == NOISY]
    flood = (min(noisy_t), max(noisy_t))
    from backends.demo_models.tiny_llama import write_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_llama(
            Path(tmp) / "llama",
            hidden_size=args.hidden,
            num_layers=args.layers,
            num_heads=4,
            num_kv_heads=2,
            pad_vocab_to=args.vocab,
        )
        proc, port, _ = start_gateway(Path(tmp), lambda p: gateway_config(p, model, args))
        try:
            client = Client(port, create_keys(port, [*QUIET, NOISY]))
            for name in POLICIES:  # warm each engine once
                asyncio.run(replay(client, f"m-{name}", trace[:4], 0.0, args.vocab))
            plan = [("noflood", "fcfs", [r for r in trace if r.tenant != NOISY])]
            plan += [(p, p, trace) for p in POLICIES]
            rounds, records = [], {}
            for rnd in range(args.rounds):
                runs = {}
                for name, policy, requests in plan:
                    started, cpu0 = time.monotonic(), thread_cpu_s(proc.pid)
                    records[name] = asyncio.run(
                        replay(client, f"m-{policy}", requests, args.time_scale, args.vocab)
                    )
                    wall = time.monotonic() - started
                    run = runs[name] = summarize_run(records[name], flood, policy, None, args.window)
                    run["cpu_cores_used"] = (thread_cpu_s(proc.pid) - cpu0) / wall
                    ok = sum(r.rows for r in records[name] if r.status == "ok")
                    run["rows_per_cpu_s"] = ok / max(1e-9, run["cpu_cores_used"] * wall)
                    log.info("run done", round=rnd, run=name, seconds=round(wall, 1))
                rounds.append(runs)
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    per_round = [compare(runs, QUIET) for runs in rounds]
    result = {
        "trace": str(args.trace),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": {
            "time_scale": args.time_scale,
            "until_trace_s": args.until,
            "flood_window_s": flood,
            "service_unit": "input tokens + 2 x output tokens (figures named rows_* are in this unit)",
            "engine": {"max_num_seqs": args.seqs, "num_threads": 1},
            "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
            "vtc_burst_tokens": args.vtc_burst,
            "jain_window_s": args.window,
        },
        "summary_median_of_rounds": median_summary(per_round),
        "summary_per_round": per_round,
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(records, flood, args.out.with_suffix(".png"))
    log.info("wrote", json=str(args.out.with_suffix(".json")), summary=result["summary_median_of_rounds"])


if __name__ == "__main__":
    main()
