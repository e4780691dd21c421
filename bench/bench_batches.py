"""Batch jobs (OpenAI Batch API) against interactive traffic, on the gateway's own torch_llm engine.

One `fleetgate serve` with one `torch_llm` deployment (a small random-weight Llama from
`write_tiny_llama`, one torch thread, `--seqs` sequences = the queue's max_concurrency). Requests are
`/v1/completions` with `--prompt` random token ids, greedy, `ignore_eos`, `--max-tokens` tokens.

Each round runs, in an order that alternates between rounds:
- `alone`: interactive load alone: `--clients` closed-loop clients for `--seconds`;
- `with_batch`: the same load while a large batch job (`--big` lines) runs, then the job is cancelled;
- `batch_idle`: a job of `--lines` requests on an otherwise idle gateway, create to `completed`;
- `client_c16`: the same requests sent by a client at concurrency 16.

Reports interactive p50/p99 latency with the batch vs without (target: p99 ratio <= 1.3) and the
job's throughput vs the client's, medians over rounds, as bench/results/batches.json and .png.

    .venv/bin/python -m bench.bench_batches [--rounds 3] [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

from bench.bench_fairness import pct
from bench.bench_fairness_gateway import Client
from bench.bench_gateway import start_gateway

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
MODEL = "llm"


def gateway_config(port: int, model: Path, workdir: Path, args: argparse.Namespace) -> str:
    queue = f"{{policy: vtc, max_concurrency: {args.seqs}, max_queue_per_tenant: 1024"
    if args.background is not None:
        queue += f", background_max_in_flight: {args.background}"
    return (
        f"server: {{port: {port}, log_level: warning, request_timeout_s: 600}}\n"
        f'state: {{url: "sqlite:///{workdir / "state.db"}"}}\n'
        f'batches: {{files_dir: "{workdir / "files"}", concurrency: {args.batch_concurrency}}}\n'
        "tenants: {bench: {}, batcher: {}}\n"
        "deployments:\n"
        f"  llm: {{backend: torch_llm, model: {model}, device: cpu, options: {{max_num_seqs: {args.seqs}, "
        f"num_threads: 1, kv_cache_bytes: {64 << 20}}}, queue: {queue}}}}}\n"
        f"models:\n  {MODEL}: {{routes: [{{deployment: llm}}]}}\n"
    )


def body(i: int, args: argparse.Namespace) -> dict:
    rng = random.Random(i)
    return {
        "model": MODEL,
        "prompt": [rng.randrange(3, args.vocab) for _ in range(args.prompt)],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }


def raw_request(port: int, key: str, payload: dict) -> bytes:
    data = msgspec.json.encode(payload)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    return head + data


async def interactive(port: int, key: str, args: argparse.Namespace) -> list[float]:
    """Closed-loop clients for `args.seconds`; latencies (s) of the requests that succeeded."""
    client = Client(port, {})
    latencies: list[float] = []
    stop = time.monotonic() + args.seconds

    async def loop(worker: int) -> None:
        i = worker * 1_000_000
        while time.monotonic() < stop:
            started = time.monotonic()
            status, _ = await client.exchange(raw_request(port, key, body(i, args)))
            if status == 200:
                latencies.append(time.monotonic() - started)
            i += 1

    await asyncio.gather(*(loop(w) for w in range(args.clients)))
    client.close()
    return latencies


async def client_c16(port: int, key: str, n: int, args: argparse.Namespace) -> float:
    """Seconds to send `n` requests at concurrency 16."""
    client = Client(port, {})
    todo = iter(range(n))
    started = time.monotonic()

    async def loop() -> None:
        for i in todo:
            status, _ = await client.exchange(raw_request(port, key, body(i, args)))
            assert status == 200, status

    await asyncio.gather(*(loop() for _ in range(16)))
    client.close()
    return time.monotonic() - started


class Batches:
    """The Batch API through plain HTTP (the SDK's calls, without its client overhead in the timing)."""

    def __init__(self, port: int, key: str) -> None:
        self.http = httpx.Client(
            base_url=f"http://127.0.0.1:{port}/v1", headers={"Authorization": f"Bearer {key}"}
        )

    def create(self, n: int, args: argparse.Namespace) -> str:
        lines = [
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body(i, args)}
            for i in range(n)
        ]
        data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
        r = self.http.post("/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
        r.raise_for_status()
        payload = {"input_file_id": r.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        r = self.http.post("/batches", json=payload)
        r.raise_for_status()
        return r.json()["id"]

    def get(self, batch_id: str) -> dict:
        return self.http.get(f"/batches/{batch_id}").json()

    def wait(self, batch_id: str, statuses: set[str], completed_at_least: int = 0) -> dict:
        while True:
            batch = self.get(batch_id)
            if batch["status"] in statuses and batch["request_counts"]["completed"] >= completed_at_least:
                return batch
            time.sleep(0.05)


def run_round(rnd: int, port: int, keys: dict[str, str], args: argparse.Namespace) -> dict:
    batches = Batches(port, keys["batcher"])
    out: dict = {}

    def alone() -> None:
        out["alone"] = asyncio.run(interactive(port, keys["bench"], args))

    def with_batch() -> None:
        job = batches.create(args.big, args)
        batches.wait(job, {"in_progress"}, completed_at_least=args.seqs)
        before = batches.get(job)["request_counts"]["completed"]
        out["with_batch"] = asyncio.run(interactive(port, keys["bench"], args))
        out["batch_lines_during_load"] = batches.get(job)["request_counts"]["completed"] - before
        batches.http.post(f"/batches/{job}/cancel").raise_for_status()
        batches.wait(job, {"cancelled"})

    def batch_idle() -> None:
        started = time.monotonic()
        job = batches.create(args.lines, args)
        done = batches.wait(job, {"completed"})
        assert done["request_counts"]["completed"] == args.lines, done
        out["batch_idle_s"] = time.monotonic() - started

    def client() -> None:
        out["client_c16_s"] = asyncio.run(client_c16(port, keys["bench"], args.lines, args))

    order = (
        [alone, with_batch, batch_idle, client] if rnd % 2 == 0 else [with_batch, alone, client, batch_idle]
    )
    for step in order:
        step()
    return out


def summarize(rounds: list[dict], args: argparse.Namespace) -> dict:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    per_round = []
    for r in rounds:
        per_round.append(
            {
                "alone_p50_ms": pct(r["alone"], 50) * 1000,
                "alone_p99_ms": pct(r["alone"], 99) * 1000,
                "alone_requests": len(r["alone"]),
                "with_batch_p50_ms": pct(r["with_batch"], 50) * 1000,
                "with_batch_p99_ms": pct(r["with_batch"], 99) * 1000,
                "with_batch_requests": len(r["with_batch"]),
                "batch_lines_during_load": r["batch_lines_during_load"],
                "batch_idle_req_s": args.lines / r["batch_idle_s"],
                "client_c16_req_s": args.lines / r["client_c16_s"],
            }
        )
    summary = {k: med([p[k] for p in per_round]) for k in per_round[0]}
    summary["p50_ratio"] = med([p["with_batch_p50_ms"] / p["alone_p50_ms"] for p in per_round])
    summary["p99_ratio"] = med([p["with_batch_p99_ms"] / p["alone_p99_ms"] for p in per_round])
    summary["batch_vs_client_throughput"] = med(
        [p["batch_idle_req_s"] / p["client_c16_req_s"] for p in per_round]
    )
    return {"summary": summary, "rounds": per_round}


def plot(rounds: list[dict], result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    alone = [x * 1000 for r in rounds for x in r["alone"]]
    loaded = [x * 1000 for r in rounds for x in r["with_batch"]]
    left.hist([alone, loaded], bins=40, label=["interactive alone", "with a batch job running"])
    left.set_xlabel("interactive latency (ms), all rounds")
    left.set_ylabel("requests")
    s = result["summary"]
    left.set_title(f"p99 ratio {s['p99_ratio']:.2f}x, p50 ratio {s['p50_ratio']:.2f}x (median of rounds)")
    left.legend()
    right.bar(["batch job (idle gateway)", "client, c=16"], [s["batch_idle_req_s"], s["client_c16_req_s"]])
    right.set_ylabel("requests/s")
    right.set_title(f"throughput: batch / client = {s['batch_vs_client_throughput']:.2f}x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=15.0, help="interactive load per phase")
    parser.add_argument("--clients", type=int, default=2, help="closed-loop interactive clients")
    parser.add_argument("--lines", type=int, default=256, help="requests of the throughput job")
    parser.add_argument("--big", type=int, default=20000, help="lines of the job running under load")
    parser.add_argument("--seqs", type=int, default=8, help="engine max_num_seqs = queue max_concurrency")
    parser.add_argument("--background", type=int, default=None, help="queue background_max_in_flight")
    parser.add_argument("--batch-concurrency", type=int, default=16, help="batches.concurrency")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=RESULTS / "batches")
    args = parser.parse_args()
    from backends.demo_models.tiny_llama import write_tiny_llama
    from bench.bench_fairness_gateway import create_keys

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = write_tiny_llama(
            work / "llama", hidden_size=args.hidden, num_layers=args.layers, num_heads=4, num_kv_heads=2,
            pad_vocab_to=args.vocab,
        )  # fmt: skip
        proc, port, _ = start_gateway(work, lambda p: gateway_config(p, model, work, args))
        try:
            keys = create_keys(port, ["bench", "batcher"])
            asyncio.run(client_c16(port, keys["bench"], 32, args))  # warm the engine
            rounds = []
            for rnd in range(args.rounds):
                rounds.append(run_round(rnd, port, keys, args))
                print(json.dumps(summarize(rounds[-1:], args)["summary"]), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    result = summarize(rounds, args)
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result["machine"] = {"platform": platform.platform(), "python": platform.python_version()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(rounds, result, args.out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=2))


if __name__ == "__main__":
    main()
