"""The HTTP stack under the gateway: httptools + uvloop ("auto", the default) vs h11 + asyncio.

Two `fleetgate serve` processes with the same config (the light MLP of bench_gateway.py on ONNX
Runtime, unbatched) run side by side; each round drives both, one after the other, at concurrency 1
and 16 with the same keep-alive binary v2 client, and reads each server's CPU time from /proc before
and after. Reported per stack: requests/s, p50/p99 latency and server CPU per request, medians over
rounds, and the ratios auto / h11.

Writes bench/results/http_stack.json. Run: `.venv/bin/python -m bench.bench_http_stack [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np

from bench.bench_gateway import RESULTS, _load, build_model, mlp_config, start_gateway, summarize, v2_request

STACKS = {"auto": ("--http", "auto", "--loop", "auto"), "h11": ("--http", "h11", "--loop", "asyncio")}
D_IN, HIDDEN = 256, 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def point(pid: int, port: int, key: str, concurrency: int, seconds: float) -> dict[str, float]:
    row = np.random.default_rng(1).standard_normal((1, D_IN), np.float32)
    request = v2_request("plain", row, key, port)
    asyncio.run(_load(port, request, concurrency, 0.3))  # warm the connections
    cpu0 = cpu_seconds(pid)
    latencies, errors, elapsed = asyncio.run(_load(port, request, concurrency, seconds))
    result = summarize(latencies, elapsed)
    result["server_cpu_ms_per_request"] = (cpu_seconds(pid) - cpu0) * 1000 / max(len(latencies), 1)
    result["errors"] = len(errors)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()

    rounds: list[dict[str, dict[str, dict[str, float]]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "light.onnx"
        build_model(model, D_IN, HIDDEN)
        servers = {
            name: start_gateway(Path(tmp), mlp_config(model, 32), flags) for name, flags in STACKS.items()
        }
        try:
            for _ in range(args.rounds):
                one: dict[str, dict[str, dict[str, float]]] = {name: {} for name in STACKS}
                for c in (1, 16):
                    for name, (proc, port, key) in servers.items():
                        one[name][f"c{c}"] = point(proc.pid, port, key, c, args.seconds)
                rounds.append(one)
        finally:
            for proc, _, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=30)

    def median(stack: str, c: str, field: str) -> float:
        return statistics.median(r[stack][c][field] for r in rounds)

    summary: dict[str, dict[str, float]] = {}
    for c in ("c1", "c16"):
        for field in ("rps", "p50_ms", "p99_ms", "server_cpu_ms_per_request"):
            for stack in STACKS:
                summary.setdefault(c, {})[f"{stack}_{field}"] = median(stack, c, field)
        summary[c]["rps_ratio_auto_over_h11"] = statistics.median(
            r["auto"][c]["rps"] / r["h11"][c]["rps"] for r in rounds
        )
        summary[c]["cpu_ratio_auto_over_h11"] = statistics.median(
            r["auto"][c]["server_cpu_ms_per_request"] / r["h11"][c]["server_cpu_ms_per_request"]
            for r in rounds
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "benchmark": "bench_http_stack",
        "model": {"d_in": D_IN, "hidden": HIDDEN},
        "summary": summary,
        "rounds": rounds,
    }
    (RESULTS / "http_stack.json").write_text(json.dumps(out, indent=2))
    from bench.plots import plot_http_stack  # the PNG beside the JSON (bench/plots.py)

    plot_http_stack(out, RESULTS / "http_stack.png")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
