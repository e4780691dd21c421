"""Soak: a gateway under steady mixed traffic for many minutes; memory, leaks and usage accounting.

One `fleetgate serve` process (SQLite state, the embedded default) serves the digits model on ONNX
Runtime (v2 JSON and TF Serving REST), the torch_llm engine on a tiny random Llama and a remote
OpenAI upstream (tests/openai_upstream.py, its own process), for two tenants with concurrency
limits and token quotas on, so every request takes leases and quota reservations. Open-loop clients
send at fixed rates well below capacity; one stream in five is dropped by its client after its first
events (a disconnect mid-stream).

Reported: the gateway's RSS every 10 s (growth after the first minute of warm-up), requests per
protocol and status, leaked state at the end (leases, open reservation journals, queue depth, in
flight), and usage against what the clients received: every answered request (a 200, streams cut by
their client included) must be counted once in the tenant's usage, and nothing else.

Writes bench/results/soak.json and .png. Run: `.venv/bin/python -m bench.soak [--minutes 10]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from backends.demo_models.digits import write_digits
from backends.demo_models.tiny_llama import write_tiny_llama
from bench.bench_gateway import ADMIN_KEY, start_gateway
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
#: requests per second of each kind: (tenant, kind, rate)
MIX = [("a", "v2", 40.0), ("a", "tfserving", 15.0), ("b", "echo_stream", 8.0), ("b", "llm_stream", 1.5)]
DROP_EVERY = 5  # one stream in five is dropped by its client after its first events


def config(port: int, tmp: Path, digits: Path, llama: Path, upstream: int) -> str:
    return f"""
server: {{port: {port}, log_level: warning}}
state: {{url: "sqlite:///{tmp / 'state.db'}"}}
tenants:
  bench: {{}}
  a: {{limits: {{max_concurrency: 200, requests_per_minute: 1000000}}, quotas: {{tokens_per_day: 1000000000}}}}
  b: {{limits: {{max_concurrency: 200, tokens_per_minute: 100000000}}, quotas: {{tokens_per_day: 1000000000}}}}
deployments:
  digits: {{backend: onnxruntime, model: {digits}, batching: {{max_batch_size: 32, max_delay_ms: 2}}}}
  llm: {{backend: torch_llm, model: {llama}, device: cpu, options: {{max_num_seqs: 8, max_model_len: 128}}}}
  echo: {{backend: remote, url: "http://127.0.0.1:{upstream}", protocol: openai, model_name: echo-upstream,
          api_key_env: TEST_UPSTREAM_KEY}}
models:
  digits: {{routes: [{{deployment: digits}}]}}
  tiny: {{routes: [{{deployment: llm}}]}}
  echo: {{routes: [{{deployment: echo}}]}}
"""


def start_upstream() -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    code = (
        "import uvicorn; from tests.openai_upstream import create_upstream; "
        f"uvicorn.run(create_upstream(), host='127.0.0.1', port={port}, log_level='warning')"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/")
            return proc, port
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("upstream did not start")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Load:
    """Open-loop clients of each kind; counts what each tenant was answered."""

    def __init__(self, url: str, keys: dict[str, str]) -> None:
        self.url = url
        self.keys = keys
        self.statuses: Counter[tuple[str, int]] = Counter()
        self.answered: Counter[str] = Counter()  # per tenant: 200s (streams cut by their client too)
        self.dropped = 0
        self.errors: Counter[str] = Counter()
        self._n = 0

    async def one(self, client: httpx.AsyncClient, tenant: str, kind: str) -> None:
        auth = {"Authorization": f"Bearer {self.keys[tenant]}"}
        self._n += 1
        try:
            if kind == "v2":
                body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [1.0] * 64}]}
                r = await client.post(f"{self.url}/v2/models/digits/infer", json=body, headers=auth)
                self._count(tenant, kind, r.status_code)
            elif kind == "tfserving":
                r = await client.post(
                    f"{self.url}/v1/models/digits:predict", json={"instances": [[2.0] * 64]}, headers=auth
                )
                self._count(tenant, kind, r.status_code)
            else:
                model = "echo" if kind == "echo_stream" else "tiny"
                prompt = " ".join(f"w{i}" for i in range(40))
                body = {"model": model, "prompt": prompt, "max_tokens": 24, "stream": True, "ignore_eos": True}
                drop = self._n % DROP_EVERY == 0
                async with client.stream("POST", f"{self.url}/v1/completions", json=body, headers=auth) as r:
                    self._count(tenant, kind, r.status_code)
                    events = 0
                    async for _ in r.aiter_lines():
                        events += 1
                        if drop and events >= 3:
                            self.dropped += 1
                            break  # the client goes away mid-stream
        except httpx.HTTPError as exc:
            self.errors[type(exc).__name__] += 1

    def _count(self, tenant: str, kind: str, status: int) -> None:
        self.statuses[(kind, status)] += 1
        if status == 200:
            self.answered[tenant] += 1

    async def run(self, seconds: float) -> None:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            tasks: set[asyncio.Task[None]] = set()
            start = time.monotonic()
            sent = Counter[str]()
            while (elapsed := time.monotonic() - start) < seconds:
                for tenant, kind, rate in MIX:
                    while sent[kind] < elapsed * rate:
                        sent[kind] += 1
                        task = asyncio.create_task(self.one(client, tenant, kind))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                await asyncio.sleep(0.01)
            await asyncio.gather(*tasks)


def leftover_state(db: Path) -> dict[str, int]:
    with sqlite3.connect(db) as conn:
        now = time.time()
        return {
            "leases_held": conn.execute("SELECT count(*) FROM leases WHERE expires_at > ?", (now,)).fetchone()[0],
            "open_journals": conn.execute("SELECT count(*) FROM journal").fetchone()[0],
        }


async def sample_rss(pid: int, out: list[tuple[float, float]], stop: asyncio.Event) -> None:
    start = time.monotonic()
    while not stop.is_set():
        out.append((time.monotonic() - start, rss_mib(pid)))
        try:
            await asyncio.wait_for(stop.wait(), 10)
        except TimeoutError:
            pass


async def soak(url: str, pid: int, keys: dict[str, str], seconds: float) -> tuple[Load, list]:
    load, rss, stop = Load(url, keys), [], asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, rss, stop))
    await load.run(seconds)
    await asyncio.sleep(2)  # let the last settlements land
    stop.set()
    await sampler
    return load, rss


def plot(rss: list[tuple[float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([t / 60 for t, _ in rss], [m for _, m in rss], marker=".")
    ax.set_xlabel("minutes")
    ax.set_ylabel("gateway RSS (MiB)")
    ax.set_title("soak: mixed protocols, streams dropped mid-way")
    fig.tight_layout()
    from bench import plotting  # bench/plotting.py: the footer with the date and machine
    plotting.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    args = parser.parse_args()
    os.environ.setdefault("TEST_UPSTREAM_KEY", "upstream-secret")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        digits = write_digits(tmp).onnx_path
        llama = write_tiny_llama(tmp / "tiny-llama")
        upstream, up_port = start_upstream()
        proc, port, _ = start_gateway(tmp, lambda p: config(p, tmp, digits, llama, up_port))
        url = f"http://127.0.0.1:{port}"
        try:
            keys = {}
            for tenant in ("a", "b"):
                r = httpx.post(
                    f"{url}/admin/keys", json={"tenant": tenant}, headers={"Authorization": f"Bearer {ADMIN_KEY}"}
                )
                keys[tenant] = r.json()["key"]
            load, rss = asyncio.run(soak(url, proc.pid, keys, args.minutes * 60))
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            rows = httpx.get(f"{url}/admin/usage", headers=admin).json()["usage"]
            usage = Counter[str]()
            for row in rows:
                if len(row["period"]) == 10:
                    usage[row["tenant"]] += int(row["requests"])
            metrics = httpx.get(f"{url}/metrics", headers=admin).text
            depth = sum(
                float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines()
                if line.startswith("fleetgate_queue_depth{")
            )
            leftovers = leftover_state(tmp / "state.db")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            upstream.terminate()
            upstream.wait(timeout=30)
    warm = [m for t, m in rss if t >= 60] or [m for _, m in rss]
    report = {
        "minutes": args.minutes,
        "mix_per_s": {f"{t}/{k}": r for t, k, r in MIX},
        "statuses": {f"{k} {s}": n for (k, s), n in sorted(load.statuses.items())},
        "client_errors": dict(load.errors),
        "streams_dropped_by_client": load.dropped,
        "rss_mib": rss,
        "rss_after_warmup_first_last_max": [warm[0], warm[-1], max(warm)],
        "rss_growth_after_warmup": (warm[-1] - warm[0]) / warm[0],
        "answered_by_tenant": dict(load.answered),
        "usage_requests_by_tenant": dict(usage),
        "usage_equals_answered": dict(usage) == dict(load.answered),
        "leftover": {**leftovers, "queue_depth": depth},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(report, indent=1))
    plot(rss, RESULTS / "soak.png")
    print(json.dumps({k: v for k, v in report.items() if k != "rss_mib"}, indent=1))


if __name__ == "__main__":
    main()
