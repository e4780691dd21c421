"""gRPC v2 vs HTTP v2 vs the runtime called directly: the same digits model, the same rows.

One `fleetgate serve` subprocess serves the demo digits model (ONNX Runtime) over HTTP and gRPC. For
1 and 64 rows per request, at concurrency 1 and 16, in interleaved rounds:
  - direct: ONNX Runtime's `session.run` in this process (threads, one per concurrent caller);
  - http:  v2 `/infer` with the binary tensor extension (as `tritonclient.http` sends it), over a
           minimal keep-alive HTTP/1.1 client, so the client's own cost stays small;
  - grpc:  `ModelInfer` with `raw_input_contents` (as `tritonclient.grpc` sends it), over one
           `grpc.aio` channel with a pre-built request.
Closed loop: each caller sends its next request when the last answer is in. Reported: req/s, p50
and p99 latency, and the gateway process's CPU per request (user + system from /proc over the run),
medians over rounds. Targets (issue 16): gRPC costs no more gateway CPU per request than HTTP; at
c=1 the gateway adds <= 0.3 ms p50 over the direct call.

Writes bench/results/grpc.json and grpc.png. Run: `.venv/bin/python -m bench.bench_grpc [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from bench.bench_fairness_gateway import thread_cpu_s
from bench.bench_gateway import _load, pct, run_direct, start_gateway, v2_request

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
ROWS = (1, 64)
CONCURRENCY = (1, 16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digits_config(
    onnx_path: Path, grpc_port: int, options: dict | None = None, backend: str = "onnxruntime"
) -> Callable[[int], str]:
    """`start_gateway`'s config maker: the digits model (ONNX Runtime, or `backend`) over HTTP and
    gRPC, no limits; `options`: the deployment's backend options."""
    rendered = json.dumps(options or {})  # JSON is YAML's flow style

    def config(port: int) -> str:
        return f"""
server: {{port: {port}, grpc_port: {grpc_port}, log_level: warning}}
state: {{url: "memory://"}}
tenants: {{bench: {{}}}}
deployments: {{ort: {{backend: {backend}, model: {onnx_path}, options: {rendered}}}}}
models: {{digits: {{routes: [{{deployment: ort}}]}}}}
"""

    return config


def summarize(latencies: list[float], seconds: float, cpu_s: float | None = None) -> dict[str, float]:
    out = {
        "requests": len(latencies),
        "rps": len(latencies) / seconds,
        "p50_ms": pct(latencies, 50) * 1000,
        "p99_ms": pct(latencies, 99) * 1000,
    }
    if cpu_s is not None and latencies:
        out["gateway_cpu_ms_per_request"] = cpu_s / len(latencies) * 1000
    return out


def run_http(
    port: int, key: str, x: np.ndarray, concurrency: int, seconds: float, pid: int
) -> dict[str, float]:
    request = v2_request("digits", x, key, port)
    asyncio.run(_load(port, request, concurrency, 0.3))
    cpu0 = thread_cpu_s(pid)
    latencies, errors, elapsed = asyncio.run(_load(port, request, concurrency, seconds))
    out = summarize(latencies, elapsed, thread_cpu_s(pid) - cpu0)
    out["errors"] = len(errors)
    return out


async def _grpc_load(
    target: str, payload: bytes, key: str, concurrency: int, seconds: float
) -> tuple[list[float], int, float]:
    import grpc

    latencies: list[float] = []
    errors = 0
    async with grpc.aio.insecure_channel(target) as channel:
        # the request is serialized once: the client's cost stays out of the measurement
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        metadata = (("authorization", f"Bearer {key}"),)
        start = time.perf_counter()
        stop = start + seconds

        async def caller() -> None:
            nonlocal errors
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                try:
                    await infer(payload, metadata=metadata)
                except grpc.RpcError:
                    errors += 1
                latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(caller() for _ in range(concurrency)))
        return latencies, errors, time.perf_counter() - start


def run_grpc(
    target: str, key: str, x: np.ndarray, concurrency: int, seconds: float, pid: int
) -> dict[str, float]:
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name="digits")
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    payload = request.SerializeToString()
    asyncio.run(_grpc_load(target, payload, key, concurrency, 0.3))
    cpu0 = thread_cpu_s(pid)
    latencies, errors, elapsed = asyncio.run(_grpc_load(target, payload, key, concurrency, seconds))
    out = summarize(latencies, elapsed, thread_cpu_s(pid) - cpu0)
    out["errors"] = errors
    return out


def median_of(rounds: list[dict], path: tuple[str, ...]) -> float:
    values = []
    for r in rounds:
        node = r
        for p in path:
            node = node[p]
        values.append(node)
    return float(statistics.median(values))


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r} row{'s' if r > 1 else ''}\nc={c}" for r in ROWS for c in CONCURRENCY]
    xs = np.arange(len(labels))
    for i, path in enumerate(("direct", "http", "grpc")):
        p50 = [summary[f"rows{r}"][f"c{c}"][path]["p50_ms"] for r in ROWS for c in CONCURRENCY]
        axes[0].bar(xs + (i - 1) * 0.27, p50, 0.27, label=path)
    axes[0].set_xticks(xs, labels)
    axes[0].set_ylabel("p50 latency (ms)")
    axes[0].set_yscale("log")
    axes[0].legend()
    for i, path in enumerate(("http", "grpc")):
        cpu = [
            summary[f"rows{r}"][f"c{c}"][path]["gateway_cpu_ms_per_request"]
            for r in ROWS
            for c in CONCURRENCY
        ]
        axes[1].bar(xs + (i - 0.5) * 0.35, cpu, 0.35, label=path)
    axes[1].set_xticks(xs, labels)
    axes[1].set_ylabel("gateway CPU per request (ms)")
    axes[1].legend()
    fig.suptitle("digits model: gRPC v2 vs HTTP v2 vs ONNX Runtime direct (medians of rounds)")
    fig.tight_layout()
    from bench import plotting  # bench/plotting.py: the footer with the date and machine

    plotting.save(fig, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from backends.demo_models.digits import digits_split, write_digits

    x_test = digits_split()[1]
    inputs = {r: np.ascontiguousarray(np.resize(x_test, (r, 64)).astype(np.float32)) for r in ROWS}
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        digits = write_digits(Path(tmp))
        grpc_port = free_port()

        proc, port, key = start_gateway(Path(tmp), digits_config(digits.onnx_path, grpc_port))
        target = f"127.0.0.1:{grpc_port}"
        try:
            for _ in range(args.rounds):
                result: dict = {}
                for rows in ROWS:
                    for c in CONCURRENCY:
                        x = inputs[rows]
                        cell = {
                            "direct": run_direct(digits.onnx_path, c, args.seconds, x.shape[1], x),
                            "http": run_http(port, key, x, c, args.seconds, proc.pid),
                            "grpc": run_grpc(target, key, x, c, args.seconds, proc.pid),
                        }
                        result.setdefault(f"rows{rows}", {})[f"c{c}"] = cell
                        print(
                            json.dumps(
                                {"rows": rows, "c": c, **{k: round(v["p50_ms"], 3) for k, v in cell.items()}}
                            )
                        )
                rounds.append(result)
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    summary: dict = {}
    for rows in ROWS:
        for c in CONCURRENCY:
            cell: dict = {}
            for path in ("direct", "http", "grpc"):
                keys = rounds[0][f"rows{rows}"][f"c{c}"][path].keys()
                cell[path] = {k: median_of(rounds, (f"rows{rows}", f"c{c}", path, k)) for k in keys}
            cell["derived"] = {
                "http_added_p50_ms": cell["http"]["p50_ms"] - cell["direct"]["p50_ms"],
                "grpc_added_p50_ms": cell["grpc"]["p50_ms"] - cell["direct"]["p50_ms"],
                "grpc_over_http_cpu_per_request": cell["grpc"]["gateway_cpu_ms_per_request"]
                / cell["http"]["gateway_cpu_ms_per_request"],
                "grpc_over_http_rps": cell["grpc"]["rps"] / cell["http"]["rps"],
            }
            summary.setdefault(f"rows{rows}", {})[f"c{c}"] = cell
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": {"seconds": args.seconds, "rounds": args.rounds, "rows": ROWS, "concurrency": CONCURRENCY},
        "summary_median_of_rounds": summary,
        "rounds": rounds,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grpc.json").write_text(json.dumps(out, indent=2))
    plot(summary, RESULTS / "grpc.png")
    print(
        json.dumps({k: {c: v["derived"] for c, v in cells.items()} for k, cells in summary.items()}, indent=1)
    )


if __name__ == "__main__":
    main()
