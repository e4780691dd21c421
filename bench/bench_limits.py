"""Cost of the policy path (auth + rate limits + quotas + reconcile) per state store, in one run.

For each store (memory, sqlite, redis) and a baseline with the policy path off, measures:
- sequential latency of one request's policy work (p50/p99 of authenticate + admit + reconcile, and
  of admit alone), one request at a time;
- throughput: admitted requests/s with `--concurrency` requests in flight on one event loop.
Limits are set high so nothing is refused (every request takes the full path). A redis-server is
started on a free loopback port when `redis-server` is on PATH (else redis is skipped, and said so).

    .venv/bin/python -m bench.bench_limits [--requests 3000] [--concurrency 32]

Writes bench/results/limits.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import structlog

from policies.admission import Admission
from policies.keys import KeyService
from policies.stores import StateStore, open_store
from policies.types import Limits, Quotas, TenantSpec

HUGE = 10**12
SPEC = TenantSpec(
    limits=Limits(requests_per_minute=HUGE, tokens_per_minute=HUGE, max_concurrency=10**6),
    quotas=Quotas(tokens_per_day=HUGE, tokens_per_month=HUGE, requests_per_day=HUGE, requests_per_month=HUGE),
    key_limits=Limits(requests_per_minute=HUGE, tokens_per_minute=HUGE),
)


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


async def _bench_store(store: StateStore | None, n: int, concurrency: int) -> dict:
    keys = KeyService(store, time.time) if store else None
    adm = Admission(store, {"acme": SPEC}, time.time) if store else None
    secret = (await keys.create("acme"))[1] if keys else ""

    async def one() -> tuple[float, float]:
        t0 = time.perf_counter()
        if keys is None or adm is None:  # policy path off: what the gateway does without it
            await asyncio.sleep(0)
            return time.perf_counter() - t0, 0.0
        principal = await keys.authenticate(secret)
        t1 = time.perf_counter()
        r = await adm.admit(principal, "m", 128)
        t2 = time.perf_counter()
        adm.headers(r)
        await adm.reconcile(r, 100)
        return time.perf_counter() - t0, t2 - t1

    for _ in range(min(200, n)):  # warm up: connections, scripts loaded, caches
        await one()
    full, admit = [], []
    for _ in range(n):
        total, a = await one()
        full.append(total)
        admit.append(a)

    sem = asyncio.Semaphore(concurrency)

    async def bounded() -> None:
        async with sem:
            await one()

    t0 = time.perf_counter()
    await asyncio.gather(*(bounded() for _ in range(n)))
    elapsed = time.perf_counter() - t0
    ms = 1000.0
    return {
        "sequential_path_p50_ms": round(_pct(full, 50) * ms, 4),
        "sequential_path_p99_ms": round(_pct(full, 99) * ms, 4),
        "sequential_admit_p50_ms": round(_pct(admit, 50) * ms, 4),
        "sequential_admit_p99_ms": round(_pct(admit, 99) * ms, 4),
        "admitted_per_s": round(n / elapsed, 1),
        "concurrency": concurrency,
        "requests": n,
    }


def _start_redis(work: Path) -> tuple[str, int] | None:
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pidfile = work / "redis.pid"
    subprocess.run(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--daemonize", "yes", "--pidfile", str(pidfile), "--dir", str(work)],
        check=True,
    )  # fmt: skip
    for _ in range(200):
        if pidfile.exists():
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                return f"redis://127.0.0.1:{port}/0", int(pidfile.read_text())
            except OSError:
                pass
        time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


async def main() -> None:
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout: results only
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "limits.json"))
    args = parser.parse_args()
    results: dict[str, dict] = {}
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        redis = _start_redis(work)
        urls = {"memory": "memory://", "sqlite": f"sqlite:///{work / 'state.db'}"}
        urls["sqlite_sync_full"] = f"sqlite:///{work / 'state_full.db'}?synchronous=full"
        if redis:
            urls["redis"] = redis[0]
        else:
            notes.append("redis skipped: redis-server not on PATH")
        try:
            results["off"] = await _bench_store(None, args.requests, args.concurrency)
            for name, url in urls.items():
                store = await open_store(url)
                try:
                    results[name] = await _bench_store(store, args.requests, args.concurrency)
                finally:
                    await store.close()
        finally:
            if redis:
                os.kill(redis[1], 15)
    base = results["off"]["sequential_path_p50_ms"]
    for r in results.values():
        r["added_p50_ms"] = round(r["sequential_path_p50_ms"] - base, 4)
    report = {
        "what": "policy path per request: authenticate + admit (rpm, tpm, concurrency per tenant and key; "
        "4 quotas) + reconcile; 'off' is the same loop with the policy path switched off",
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
        },
        "results": results,
        "notes": notes,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    from bench.plots import plot_limits  # the PNG beside the JSON (bench/plots.py)

    plot_limits(report, Path(args.out).with_suffix(".png"))
    sys.stdout.write(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())
