"""Gateway overhead and dynamic batching, side by side in one run.

Compares, on the same ONNX model and the same machine:
  (a) onnxruntime called directly (threads calling `session.run`, one row per call), and
  (b) fleetgate's v2 `/infer` endpoint (a `fleetgate serve` subprocess), without and with dynamic batching,
at concurrency 1 and 32. The client is a minimal keep-alive HTTP/1.1 client on asyncio streams, so
its own cost stays small next to the server's; requests use the binary tensor extension, as
tritonclient does by default.

Writes bench/results/gateway.json. Run: `.venv/bin/python -m bench.bench_gateway [--seconds 5]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ADMIN_KEY = "bench-admin-key"


def build_model(path: Path, d_in: int, hidden: int) -> None:
    """An MLP d_in -> hidden -> hidden -> 10: small, but with enough weights that a call costs something."""
    rng = np.random.default_rng(0)
    w = {
        "W1": rng.standard_normal((d_in, hidden), np.float32) * 0.05,
        "W2": rng.standard_normal((hidden, hidden), np.float32) * 0.05,
        "W3": rng.standard_normal((hidden, 10), np.float32) * 0.05,
    }
    nodes = [
        helper.make_node("MatMul", ["input", "W1"], ["a"]),
        helper.make_node("Relu", ["a"], ["b"]),
        helper.make_node("MatMul", ["b", "W2"], ["c"]),
        helper.make_node("Relu", ["c"], ["d"]),
        helper.make_node("MatMul", ["d", "W3"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "bench_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", d_in])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 10])],
        initializer=[numpy_helper.from_array(v, k) for k, v in w.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def summarize(latencies: list[float], seconds: float) -> dict[str, float]:
    return {
        "requests": len(latencies),
        "rps": len(latencies) / seconds,
        "p50_ms": pct(latencies, 50) * 1000,
        "p99_ms": pct(latencies, 99) * 1000,
    }


# --- (a) direct onnxruntime ----------------------------------------------------------------------


def run_direct(
    model: Path, concurrency: int, seconds: float, d_in: int, x: np.ndarray | None = None
) -> dict[str, float]:
    """`session.run` on `x` (default: one random row of `d_in`) from `concurrency` threads."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    if x is None:
        x = np.random.default_rng(1).standard_normal((1, d_in), np.float32)
    session.run(None, {"input": x})
    stop = time.perf_counter() + seconds
    per_thread: list[list[float]] = [[] for _ in range(concurrency)]

    def worker(out: list[float]) -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            session.run(None, {"input": x})
            out.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=worker, args=(o,)) for o in per_thread]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize([v for o in per_thread for v in o], time.perf_counter() - start)


# --- (b) through the gateway ---------------------------------------------------------------------


def v2_request(model: str, row: np.ndarray | dict[str, np.ndarray], key: str, port: int) -> bytes:
    """One keep-alive POST with `row` as a binary FP32 tensor named `input` (or each of several named
    inputs), every output asked for as binary."""
    inputs = row if isinstance(row, dict) else {"input": row}
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": name,
                    "shape": list(a.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": a.nbytes},
                }
                for name, a in inputs.items()
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    body = header + b"".join(a.tobytes() for a in inputs.values())
    head = (
        f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/octet-stream\r\n"
        f"Inference-Header-Content-Length: {len(header)}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


async def _one_connection(
    port: int, request: bytes, stop: float, out: list[float], errors: list[str]
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            if status != 200:
                errors.append(str(status))
            out.append(time.perf_counter() - t0)
    finally:
        writer.close()


async def _load(
    port: int, request: bytes, concurrency: int, seconds: float
) -> tuple[list[float], list[str], float]:
    out: list[float] = []
    errors: list[str] = []
    start = time.perf_counter()
    stop = start + seconds
    await asyncio.gather(*(_one_connection(port, request, stop, out, errors) for _ in range(concurrency)))
    return out, errors, time.perf_counter() - start


def run_gateway(
    port: int, model: str, key: str, concurrency: int, seconds: float, d_in: int
) -> dict[str, float]:
    row = np.random.default_rng(1).standard_normal((1, d_in), np.float32)
    request = v2_request(model, row, key, port)
    asyncio.run(_load(port, request, concurrency, 0.5))  # warm-up
    latencies, errors, elapsed = asyncio.run(_load(port, request, concurrency, seconds))
    result = summarize(latencies, elapsed)
    result["errors"] = len(errors)
    return result


def start_gateway(
    workdir: Path,
    make_config: Callable[[int], str],
    serve_args: tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
) -> tuple[subprocess.Popen[bytes], int, str]:
    """A `fleetgate serve` subprocess on a free port; returns it, the port and a key of tenant `bench`.

    `make_config(port)` returns the YAML to serve; its log goes to a file in `workdir`; `serve_args`
    are extra `fleetgate serve` flags (e.g. `("--http", "h11")`); `env` adds to its environment.
    """
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = workdir / f"gateway-{port}.yaml"
    config.write_text(make_config(port))
    log_path = workdir / f"gateway-{port}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.serve.cli", "serve", "--config", str(config), *serve_args],
        cwd=ROOT,
        # gRPC off unless the config sets server.grpc_port: benches run gateways side by side
        env={"FLEETGATE_GRPC_PORT": "off", **os.environ, **(env or {}), "FLEETGATE_ADMIN_KEY": ADMIN_KEY},
        stdout=subprocess.DEVNULL,
        stderr=log_path.open("wb"),  # a file, not a pipe nobody drains
    )
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"gateway did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.2)
    r = httpx.post(
        f"http://127.0.0.1:{port}/admin/keys",
        json={"tenant": "bench"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    r.raise_for_status()
    return proc, port, r.json()["key"]


def mlp_config(model: Path, max_batch: int) -> Callable[[int], str]:
    """Two deployments of one model, without and with dynamic batching."""

    def make(port: int) -> str:
        return f"""
server: {{port: {port}, log_level: warning}}
state: {{url: "memory://"}}
tenants: {{bench: {{}}}}
deployments:
  plain: {{backend: onnxruntime, model: {model}, queue: {{max_concurrency: 64}}}}
  batched:
    backend: onnxruntime
    model: {model}
    batching: {{max_batch_size: {max_batch}, max_delay_ms: 1}}
    queue: {{max_concurrency: 128}}
models:
  plain: {{routes: [{{deployment: plain}}]}}
  batched: {{routes: [{{deployment: batched}}]}}
"""

    return make


#: (name, d_in, hidden): "light" is dominated by per-request overhead, "heavy" by weight reads
PRESETS = [("light", 256, 1024), ("heavy", 512, 4096)]


def measure(tmp: Path, name: str, d_in: int, hidden: int, seconds: float, max_batch: int) -> dict:
    model = tmp / f"{name}.onnx"
    build_model(model, d_in, hidden)
    results: dict[str, dict[str, dict[str, float]]] = {
        "direct": {},
        "gateway_unbatched": {},
        "gateway_batched": {},
    }
    for c in (1, 32):
        results["direct"][f"c{c}"] = run_direct(model, c, seconds, d_in)
    proc, port, key = start_gateway(tmp, mlp_config(model, max_batch))
    try:
        for c in (1, 32):
            results["gateway_unbatched"][f"c{c}"] = run_gateway(port, "plain", key, c, seconds, d_in)
            results["gateway_batched"][f"c{c}"] = run_gateway(port, "batched", key, c, seconds, d_in)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    d, u, b = results["direct"], results["gateway_unbatched"], results["gateway_batched"]
    derived = {
        "gateway_added_p50_ms_c1_unbatched": u["c1"]["p50_ms"] - d["c1"]["p50_ms"],
        "gateway_added_p50_ms_c1_batched": b["c1"]["p50_ms"] - d["c1"]["p50_ms"],
        "batched_over_unbatched_rps_c32": b["c32"]["rps"] / u["c32"]["rps"],
        "gateway_batched_over_direct_rps_c32": b["c32"]["rps"] / d["c32"]["rps"],
    }
    return {"model": {"kind": "mlp", "d_in": d_in, "hidden": hidden}, "results": results, "derived": derived}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--max-batch", type=int, default=32)
    args = parser.parse_args()

    RESULTS.mkdir(parents=True, exist_ok=True)
    models = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, d_in, hidden in PRESETS:
            models[name] = measure(Path(tmp), name, d_in, hidden, args.seconds, args.max_batch)
    out = {
        "benchmark": "bench_gateway",
        "seconds_per_point": args.seconds,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "onnxruntime": ort.__version__,
        },
        "models": models,
    }
    (RESULTS / "gateway.json").write_text(json.dumps(out, indent=2))
    from bench.plots import plot_gateway  # the PNG beside the JSON (bench/plots.py)

    plot_gateway(out, RESULTS / "gateway.png")
    for name, m in models.items():
        for kind, points in m["results"].items():
            for c, r in points.items():
                print(
                    f"{name:6s} {kind:18s} {c:4s} rps={r['rps']:8.1f} p50={r['p50_ms']:7.3f}ms p99={r['p99_ms']:8.3f}ms"
                )
        print(name, json.dumps(m["derived"]))


if __name__ == "__main__":
    main()
