"""ONNX Runtime runs in flight: the default (`max_parallel_runs: 0`, one run per `intra_op_threads`
cores, so one run with ONNX Runtime's own thread count) against two runs (the default before it),
side by side in one run.

Two `fleetgate serve` processes differ only in that option. Both serve bench_tensor_peers' model
(the issue #14 MLP, 512 -> 4096 -> 4096 -> 10, batching `{max_batch_size: 64, max_delay_ms: 2}`,
a tenant without limits). bench_gateway's closed-loop keep-alive client sends one-row JSON v2
bodies at c=1 and c=32 for `--seconds`; the two gateways alternate order round by round. Per point
and round: requests/s, p50, and the server process's CPU (every thread, from /proc) a request.
Reported: medians over rounds, and two runs / one run as the median of per-round ratios with its
range. Also the batch sizes each gateway ran at c=32 (`fleetgate_batch_size_rows` from /metrics).

Writes bench/results/parallel_runs.json and .png.
Run: `.venv/bin/python -m bench.bench_parallel_runs [--rounds 6 --seconds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np

from bench import bench_tensor_peers as peers
from bench.bench_gateway import ADMIN_KEY, _load, build_model, start_gateway, summarize
from bench.servers import stop

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
#: name -> the deployment's `options` (appended to bench_tensor_peers' gateway config)
GATEWAYS = {"default": "", "two_runs": ", options: {max_parallel_runs: 2}"}
CONCURRENCY = (1, 32)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid`, every thread."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def batch_rows(port: int) -> dict[str, float]:
    """The cumulative `fleetgate_batch_size_rows` buckets (le -> count) the gateway exports."""
    text = httpx.get(
        f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ).text
    return dict(re.findall(r'fleetgate_batch_size_rows_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)', text))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    rounds: list[dict] = []
    batches: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        model = tmp / "mlp.onnx"
        build_model(model, peers.D_IN, peers.HIDDEN)
        row = np.random.default_rng(1).standard_normal((1, peers.D_IN), np.float32)
        servers = {}
        for name, options in GATEWAYS.items():
            proc, port, key = start_gateway(
                tmp, lambda p, o=options: peers.GATEWAY_CONFIG.format(port=p, model=model, options=o)
            )
            stack.callback(stop, proc, False)
            servers[name] = (
                proc.pid,
                port,
                peers.raw_request(port, peers.request_specs(key, row)["fleetgate"]),
            )
        for r in range(args.rounds):
            found: dict = {}
            for c in CONCURRENCY:
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for name in order:
                    pid, port, request = servers[name]
                    asyncio.run(_load(port, request, c, 0.5))  # warm the connections and the batcher
                    before_rows = batch_rows(port) if c == 32 else {}
                    cpu_before = process_cpu_s(pid)
                    latencies, errors, elapsed = asyncio.run(_load(port, request, c, args.seconds))
                    cpu = process_cpu_s(pid) - cpu_before
                    point = summarize(latencies, elapsed)
                    point.update(errors=len(errors), cpu_ms_per_request=cpu * 1e3 / max(1, len(latencies)))
                    found.setdefault(name, {})[f"c{c}"] = point
                    if c == 32:
                        after = batch_rows(port)
                        for le, count in after.items():
                            seen = batches.setdefault(name, {})
                            seen[le] = seen.get(le, 0) + float(count) - float(before_rows.get(le, 0))
            rounds.append(found)
            print(r, {n: {c: round(p["rps"]) for c, p in v.items()} for n, v in found.items()}, flush=True)

    keys = ("rps", "p50_ms", "cpu_ms_per_request")
    median = {
        name: {
            f"c{c}": {k: statistics.median(r[name][f"c{c}"][k] for r in rounds) for k in keys}
            for c in CONCURRENCY
        }
        for name in GATEWAYS
    }
    ratios = {}
    for c in CONCURRENCY:
        for k in keys:
            series = [r["two_runs"][f"c{c}"][k] / r["default"][f"c{c}"][k] for r in rounds]
            ratios[f"two_runs_over_default_c{c}_{k}"] = {
                "median": statistics.median(series),
                "range": [min(series), max(series)],
            }
    out = {
        "benchmark": "bench_parallel_runs",
        "method": __doc__,
        "gateways": GATEWAYS,
        "rounds": args.rounds,
        "seconds_per_point": args.seconds,
        "machine": {"cpus": os.cpu_count()},
        "median": median,
        "ratios": ratios,
        "batch_size_rows_cumulative_c32": batches,
        "per_round": rounds,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "parallel_runs.json").write_text(json.dumps(out, indent=1))
    from bench.plotting import figure, grouped_bars, save

    fig, axes = figure(1, 2, size=(10, 4))
    groups = [f"c={c}" for c in CONCURRENCY]
    for ax, key, label in (
        (axes[0], "rps", "requests/s"),
        (axes[1], "cpu_ms_per_request", "server CPU a request (ms)"),
    ):
        grouped_bars(
            ax,
            groups,
            {n: [median[n][f"c{c}"][key] for c in CONCURRENCY] for n in GATEWAYS},
            fmt="{:.2f}" if key != "rps" else "{:.0f}",
        )
        ax.set_ylabel(label)
    fig.suptitle("ONNX Runtime runs in flight: default (one) vs two, issue #14 MLP")
    save(fig, RESULTS / "parallel_runs.png")
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
