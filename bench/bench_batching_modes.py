"""Batching modes side by side through the gateway: `continuous` (run at once when the runtime is
idle, merge what arrives while it is busy) against `delay` (wait up to max_delay_ms for company).

One `fleetgate serve` process holds four ONNX Runtime deployments: the digits MLP and the small CNN of
bench_runtimes_gateway, each once per mode (`batching: {max_batch_size: 64, max_delay_ms: 2}`).
Closed-loop keep-alive clients send one row per request (binary v2 bodies encoded before the clock
starts) at c = 1, 8, 32, 128; the two modes of a point run back to back, rounds interleave, and the
median over rounds is reported with the ratio continuous / delay taken within each round.

Writes bench/results/batching_modes.json and .png. Run: `.venv/bin/python -m bench.bench_batching_modes`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from bench.bench_gateway import _load, start_gateway, summarize, v2_request
from bench.bench_runtimes_gateway import write_models

MODES = ("continuous", "delay")
CONCURRENCY = (1, 8, 32, 128)
RESULTS = Path(__file__).resolve().parent / "results"


def config(port: int, models: dict[str, Path]) -> str:
    lines = [f"server: {{port: {port}, log_level: warning}}", 'state: {url: "memory://"}', "tenants: {bench: {}}"]
    lines.append("deployments:")
    for name, path in models.items():
        for mode in MODES:
            lines.append(
                f"  {name}-{mode}: {{backend: onnxruntime, model: {path}, queue: {{max_concurrency: 256}}, "
                f"batching: {{max_batch_size: 64, max_delay_ms: 2, mode: {mode}}}}}"
            )
    lines.append("models:")
    lines += [f"  {n}-{m}: {{routes: [{{deployment: {n}-{m}}}]}}" for n in models for m in MODES]
    return "\n".join(lines) + "\n"


def measure(port: int, key: str, model: str, row: np.ndarray, c: int, seconds: float) -> dict[str, float]:
    request = v2_request(model, row, key, port)
    asyncio.run(_load(port, request, c, 0.3))  # warm-up
    latencies, errors, elapsed = asyncio.run(_load(port, request, c, seconds))
    return {**summarize(latencies, elapsed), "errors": len(errors)}


def plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, model in enumerate(sorted({p["model"] for p in points})):
        for mode in MODES:
            rows = [p for p in points if p["model"] == model]
            cs = [p["concurrency"] for p in rows]
            axes[0][col].plot(cs, [p[mode]["rps"] for p in rows], marker="o", label=mode)
            axes[1][col].plot(cs, [p[mode]["p50_ms"] for p in rows], marker="o", label=mode)
        axes[0][col].set_title(f"{model}: requests/s (1 row each)")
        axes[1][col].set_title(f"{model}: p50 latency (ms)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency")
            ax.legend()
    fig.tight_layout()
    from bench import plotting  # bench/plotting.py: the footer with the date and machine
    plotting.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models = write_models(Path(tmp))
        onnx_paths = {name: paths[0] for name, paths in models.items()}
        proc, port, key = start_gateway(Path(tmp), lambda p: config(p, onnx_paths))
        try:
            rounds: list[list[dict]] = []
            for r in range(args.rounds):
                out = []
                for name, (_, _, pool) in models.items():
                    row = np.ascontiguousarray(pool[:1])
                    for c in CONCURRENCY:
                        point = {"model": name, "concurrency": c}
                        order = MODES if r % 2 == 0 else MODES[::-1]
                        for mode in order:
                            point[mode] = measure(port, key, f"{name}-{mode}", row, c, args.seconds)
                        point["rps_ratio"] = point["continuous"]["rps"] / point["delay"]["rps"]
                        point["p50_ratio"] = point["continuous"]["p50_ms"] / point["delay"]["p50_ms"]
                        print(json.dumps(point), flush=True)
                        out.append(point)
                rounds.append(out)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    median = []
    for i, first in enumerate(rounds[0]):
        same = [rnd[i] for rnd in rounds]
        point = {"model": first["model"], "concurrency": first["concurrency"]}
        for mode in MODES:
            point[mode] = {k: statistics.median(p[mode][k] for p in same) for k in first[mode]}
        for k in ("rps_ratio", "p50_ratio"):
            point[k] = statistics.median(p[k] for p in same)
        median.append(point)
    RESULTS.mkdir(exist_ok=True)
    report = {"seconds": args.seconds, "rounds": args.rounds, "median": median, "raw": rounds}
    (RESULTS / "batching_modes.json").write_text(json.dumps(report, indent=1))
    plot(median, RESULTS / "batching_modes.png")


if __name__ == "__main__":
    main()
