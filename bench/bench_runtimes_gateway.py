"""ONNX Runtime and OpenVINO, direct and through the gateway, batched and unbatched, in one run.

Two models, each as ONNX and as OpenVINO IR (f32):
  - digits: the demo MLP 64-32-10 (`backends.demo_models.digits.write_digits`): a call of microseconds;
  - cnn: a ResNet-like CNN on 3x64x64 inputs with random weights (~0.85 GFLOP per row), built here.
Three runtimes per model: onnxruntime (CPU provider), openvino with the LATENCY hint, openvino with the
THROUGHPUT hint. For each batch size B (rows per request: 1, 8, 64) and concurrency c (1, 16):
  - direct: the runtime's own Python API from c threads, each call on B rows, configured as the adapter
    configures it (`session.run` without spinning threads; one infer request per thread on a model
    compiled with the adapter's hint and f32 precision);
  - gateway unbatched / batched: the v2 `/infer` endpoint of a `fleetgate serve` subprocess, one
    deployment per runtime/hint, with and without `batching: {max_batch_size: 256, max_delay_ms: 2}`,
    driven by bench_gateway's keep-alive client with the binary tensor extension, B rows per request;
  - direct at the effective batch size: the batched deployment merges requests, so it is also compared
    with the runtime called directly on batches of the mean merged size (read from the gateway's
    `fleetgate_batch_size_rows` metric), from as many threads as the deployment runs batches at once.
"At the same batch size" thus means rows per runtime call, and throughput is compared in rows/s.
Each round runs every point once, the four ways back to back; ratios are taken within a round and the
report gives their median over rounds, so a change in the machine's background load hits both sides.
CPU per request is split: the gateway process (all its threads) and this load generator.

Writes bench/results/runtimes_gateway.json (+ .png); `--model` runs one model and keeps the other's
results in the file. Run: `.venv/bin/python -m bench.bench_runtimes_gateway [--model digits] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import openvino as ov
from onnx import TensorProto, helper, numpy_helper

from backends.cores import available_cores
from backends.demo_models.digits import write_digits
from backends.demo_models.exports import write_openvino_ir
from backends.onnxruntime import OnnxOptions, parallel_runs
from bench.bench_gateway import ADMIN_KEY, _load, start_gateway, summarize, v2_request

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
CONCURRENCY = (1, 16)
BATCH_SIZES = (1, 8, 64)
RUNTIMES = ("onnxruntime", "openvino_latency", "openvino_throughput")
MODES = ("direct", "gateway_unbatched", "gateway_batched", "direct_at_effective_batch")
#: ORT runs (and batches) in flight in the gateway on this machine: OnnxOptions.max_parallel_runs' default
ORT_PARALLEL_RUNS = parallel_runs(OnnxOptions(), True, available_cores())
MAX_BATCH_ROWS = 256
#: channels of the CNN's three stages: ~0.85 GFLOP per 3x64x64 row, so that compute, not per-request
#: overhead, dominates (the digits MLP is the other extreme: microseconds per row)
CNN_WIDTHS = (96, 192, 384)


# --- the models ----------------------------------------------------------------------------------


def build_cnn(path: Path) -> None:
    """A ResNet-like CNN: 3x64x64 -> conv s2 -> res block -> maxpool -> conv -> res block -> maxpool -> conv -> GAP -> fc10."""
    rng = np.random.default_rng(0)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def conv(x: str, c_in: int, c_out: int, name: str, stride: int = 1, relu: bool = True) -> str:
        w = (rng.standard_normal((c_out, c_in, 3, 3)) * np.sqrt(2.0 / (9 * c_in))).astype(
            np.float32
        )  # He init
        inits.append(numpy_helper.from_array(w, f"{name}_w"))
        inits.append(numpy_helper.from_array(np.zeros(c_out, np.float32), f"{name}_b"))
        nodes.append(
            helper.make_node(
                "Conv",
                [x, f"{name}_w", f"{name}_b"],
                [f"{name}_c"],
                pads=[1, 1, 1, 1],
                strides=[stride, stride],
            )
        )
        if not relu:
            return f"{name}_c"
        nodes.append(helper.make_node("Relu", [f"{name}_c"], [name]))
        return name

    def residual(x: str, c: int, name: str) -> str:
        y = conv(conv(x, c, c, f"{name}a"), c, c, f"{name}b", relu=False)
        nodes.append(helper.make_node("Add", [x, y], [f"{name}_sum"]))
        nodes.append(helper.make_node("Relu", [f"{name}_sum"], [name]))
        return name

    w1, w2, w3 = CNN_WIDTHS
    x = residual(conv("input", 3, w1, "stem", stride=2), w1, "res1")  # w1 x 32x32
    nodes.append(helper.make_node("MaxPool", [x], ["pool1"], kernel_shape=[2, 2], strides=[2, 2]))
    x = residual(conv("pool1", w1, w2, "widen1"), w2, "res2")  # w2 x 16x16
    nodes.append(helper.make_node("MaxPool", [x], ["pool2"], kernel_shape=[2, 2], strides=[2, 2]))
    x = conv("pool2", w2, w3, "widen2")  # w3 x 8x8
    nodes.append(helper.make_node("GlobalAveragePool", [x], ["gap"]))
    nodes.append(helper.make_node("Flatten", ["gap"], ["flat"], axis=1))
    fc = (rng.standard_normal((w3, 10)) * np.sqrt(1.0 / w3)).astype(np.float32)
    inits += [numpy_helper.from_array(fc, "fc_w"), numpy_helper.from_array(np.zeros(10, np.float32), "fc_b")]
    nodes.append(helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"]))
    graph = helper.make_graph(
        nodes,
        "bench_cnn",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 64, 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)


def write_models(tmp: Path) -> dict[str, tuple[Path, Path, np.ndarray]]:
    """name -> (onnx path, IR xml path, a pool of input rows to slice batches from)."""
    rng = np.random.default_rng(1)
    digits = write_digits(tmp)
    cnn = tmp / "cnn.onnx"
    build_cnn(cnn)
    rows = {
        "digits": rng.integers(0, 17, (max(BATCH_SIZES) * 4, 64)).astype(np.float32),
        "cnn": rng.standard_normal((max(BATCH_SIZES) * 4, 3, 64, 64), np.float32),
    }
    onnx_paths = {"digits": digits.onnx_path, "cnn": cnn}
    return {n: (p, write_openvino_ir(p, tmp / f"{n}.xml"), rows[n]) for n, p in onnx_paths.items()}


# --- direct --------------------------------------------------------------------------------------


class Direct:
    """One runtime called through its own Python API; `caller(batch)` makes a per-thread callable."""

    def __init__(self, runtime: str, onnx_path: Path, xml: Path) -> None:
        self.runtime = runtime
        if runtime == "onnxruntime":
            # the adapter's session options (backends/onnxruntime.py defaults): no spinning threads
            opts = ort.SessionOptions()
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self.session = ort.InferenceSession(
                str(onnx_path), sess_options=opts, providers=["CPUExecutionProvider"]
            )
            self.slots = ORT_PARALLEL_RUNS
            return
        hint = "LATENCY" if runtime == "openvino_latency" else "THROUGHPUT"
        # the same compile config as backends/openvino.py with `performance_hint: <hint>`
        self.compiled = ov.Core().compile_model(
            str(xml), "CPU", {"PERFORMANCE_HINT": hint, "INFERENCE_PRECISION_HINT": "f32"}
        )
        self.slots = int(self.compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))

    def caller(self, batch: np.ndarray) -> Callable[[], object]:
        if self.runtime == "onnxruntime":
            return lambda: self.session.run(None, {"input": batch})
        request = self.compiled.create_infer_request()  # not thread-safe: one per thread
        return lambda: request.infer({0: batch}, share_inputs=True)


def _threads(calls: list[Callable[[], object]], seconds: float) -> tuple[list[float], float]:
    """Closed loop: each thread calls until the deadline; elapsed runs until the last call returns."""
    per_thread: list[list[float]] = [[] for _ in calls]
    stop = time.perf_counter() + seconds

    def worker(call: Callable[[], object], out: list[float]) -> None:
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=worker, args=a) for a in zip(calls, per_thread, strict=True)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [v for o in per_thread for v in o], time.perf_counter() - start


def process_cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system, all threads) used so far by this process or by `pid`."""
    if pid is None:
        return time.process_time()
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def run_direct(direct: Direct, batch: np.ndarray, threads: int, seconds: float) -> dict[str, float]:
    calls = [direct.caller(batch) for _ in range(threads)]
    _threads(calls, min(0.3, seconds))  # warm-up
    cpu0 = process_cpu_s()
    latencies, elapsed = _threads(calls, seconds)
    n = max(1, len(latencies))
    return {
        **summarize(latencies, elapsed),
        "rows_per_s": len(latencies) * batch.shape[0] / elapsed,
        "cpu_ms_per_request": 1000 * (process_cpu_s() - cpu0) / n,
    }


# --- through the gateway -------------------------------------------------------------------------


def deployment_name(model: str, runtime: str, batched: bool) -> str:
    return f"{model}-{runtime.replace('_', '-')}-{'batched' if batched else 'unbatched'}"


def gateway_config(port: int, model: str, onnx_path: Path, xml: Path) -> str:
    lines = [
        f"server: {{port: {port}, log_level: warning}}",
        'state: {url: "memory://"}',
        "tenants: {bench: {}}",
        "deployments:",
    ]
    names = []
    for runtime in RUNTIMES:
        if runtime == "onnxruntime":
            body = f"backend: onnxruntime, model: {onnx_path}"
        else:
            hint = "LATENCY" if runtime == "openvino_latency" else "THROUGHPUT"
            body = f"backend: openvino, model: {xml}, options: {{performance_hint: {hint}}}"
        for batched in (False, True):
            name = deployment_name(model, runtime, batched)
            names.append(name)
            batching = f", batching: {{max_batch_size: {MAX_BATCH_ROWS}, max_delay_ms: 2}}" if batched else ""
            lines.append(f"  {name}: {{{body}{batching}, queue: {{max_concurrency: 64}}}}")
    lines.append("models:")
    lines += [f"  {n}: {{routes: [{{deployment: {n}}}]}}" for n in names]
    return "\n".join(lines) + "\n"


def batch_rows_metric(port: int, deployment: str) -> tuple[float, float]:
    """(sum, count) of the gateway's `fleetgate_batch_size_rows` histogram for one deployment."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    values = {"sum": 0.0, "count": 0.0}
    for kind in values:
        prefix = f'fleetgate_batch_size_rows_{kind}{{deployment="{deployment}"}} '
        for line in text.splitlines():
            if line.startswith(prefix):
                values[kind] = float(line[len(prefix) :])
    return values["sum"], values["count"]


def run_gateway(
    pid: int, port: int, request: bytes, rows: int, concurrency: int, seconds: float
) -> dict[str, float]:
    """Closed-loop load on the gateway; also the CPU the server and this load generator spent per request."""
    asyncio.run(_load(port, request, concurrency, min(0.3, seconds)))  # warm-up
    client0, server0 = process_cpu_s(), process_cpu_s(pid)
    latencies, errors, elapsed = asyncio.run(_load(port, request, concurrency, seconds))
    n = max(1, len(latencies))
    return {
        **summarize(latencies, elapsed),
        "rows_per_s": len(latencies) * rows / elapsed,
        "errors": len(errors),
        "server_cpu_ms_per_request": 1000 * (process_cpu_s(pid) - server0) / n,
        "client_cpu_ms_per_request": 1000 * (process_cpu_s() - client0) / n,
    }


# --- one run -------------------------------------------------------------------------------------


def one_round(
    model: str, directs: dict[str, Direct], pool: np.ndarray, gw: tuple[int, int, str], seconds: float
) -> list[dict]:
    """Every (runtime, batch size, concurrency) point once, its four ways back to back."""
    pid, port, key = gw
    out: list[dict] = []
    for runtime in RUNTIMES:
        direct = directs[runtime]
        for rows in BATCH_SIZES:
            batch = np.ascontiguousarray(pool[:rows])
            for c in CONCURRENCY:
                point = {"model": model, "runtime": runtime, "rows_per_request": rows, "concurrency": c}
                by_mode = {"direct": run_direct(direct, batch, c, seconds)}
                for batched in (False, True):
                    name = deployment_name(model, runtime, batched)
                    before = batch_rows_metric(port, name) if batched else (0.0, 0.0)
                    request = v2_request(name, batch, key, port)
                    result = run_gateway(pid, port, request, rows, c, seconds)
                    if batched:
                        after = batch_rows_metric(port, name)
                        runs = max(1.0, after[1] - before[1])
                        result["effective_rows_per_batch"] = (after[0] - before[0]) / runs
                    by_mode["gateway_batched" if batched else "gateway_unbatched"] = result
                effective = max(1, round(by_mode["gateway_batched"]["effective_rows_per_batch"]))
                threads = min(c, direct.slots)
                if (effective, threads) == (rows, c):
                    by_mode["direct_at_effective_batch"] = by_mode["direct"]
                else:
                    big = np.ascontiguousarray(pool[:effective])
                    by_mode["direct_at_effective_batch"] = run_direct(direct, big, threads, seconds)
                by_mode["direct_at_effective_batch"] = {
                    **by_mode["direct_at_effective_batch"],
                    "rows_per_call": effective,
                    "threads": threads,
                }
                point["modes"] = by_mode
                log_point(point)
                out.append(point)
    return out


def log_point(p: dict) -> None:
    m = p["modes"]
    d = m["direct"]["rows_per_s"]
    sys.stderr.write(
        f"{p['model']:6s} {p['runtime']:19s} B={p['rows_per_request']:<2d} c={p['concurrency']:<2d} rows/s "
        f"direct={d:9.0f} unbatched={m['gateway_unbatched']['rows_per_s'] / d:5.3f} "
        f"batched={m['gateway_batched']['rows_per_s'] / d:5.3f} "
        f"batched/direct@{m['direct_at_effective_batch']['rows_per_call']}="
        f"{m['gateway_batched']['rows_per_s'] / m['direct_at_effective_batch']['rows_per_s']:5.3f} "
        f"server_cpu_ms/req={m['gateway_unbatched']['server_cpu_ms_per_request']:.3f} "
        f"client={m['gateway_unbatched']['client_cpu_ms_per_request']:.3f}\n"
    )


#: ratio name -> (numerator mode, denominator mode), both in rows/s
RATIOS = {
    "gateway_unbatched_over_direct": ("gateway_unbatched", "direct"),
    "gateway_batched_over_direct": ("gateway_batched", "direct"),
    "gateway_batched_over_direct_at_effective_batch": ("gateway_batched", "direct_at_effective_batch"),
}


def summarize_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Per point: each ratio per round and its median, and the median of each mode's figures."""
    table = []
    for i, first in enumerate(rounds[0]):
        same = [r[i]["modes"] for r in rounds]
        per_round = {
            name: [round(m[num]["rows_per_s"] / m[den]["rows_per_s"], 3) for m in same]
            for name, (num, den) in RATIOS.items()
        }
        modes = {
            mode: {
                k: round(statistics.median(m[mode][k] for m in same), 3)
                for k, v in first["modes"][mode].items()
                if isinstance(v, int | float)
            }
            for mode in MODES
        }
        table.append(
            {
                **{k: first[k] for k in ("model", "runtime", "rows_per_request", "concurrency")},
                **{name: round(statistics.median(v), 3) for name, v in per_round.items()},
                "rounds": per_round,  # how much the shared machine moved each ratio
                "modes": modes,
            }
        )
    return table


def measure_model(
    tmp: Path, model: str, onnx_path: Path, xml: Path, pool: np.ndarray, seconds: float, rounds: int
) -> list[dict]:
    proc, port, key = start_gateway(tmp, lambda port: gateway_config(port, model, onnx_path, xml))
    try:
        directs = {runtime: Direct(runtime, onnx_path, xml) for runtime in RUNTIMES}
        results = []
        for r in range(rounds):
            sys.stderr.write(f"--- {model}: round {r + 1}/{rounds}\n")
            results.append(one_round(model, directs, pool, (proc.pid, port, key), seconds))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return summarize_rounds(results)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in ("digits", "cnn") if any(p["model"] == m for p in report["table"])]
    fig, axes = plt.subplots(len(models), 1, figsize=(15, 4.2 * len(models)), squeeze=False)
    bars = (
        ("gateway_unbatched_over_direct", "gateway unbatched / direct (same B)"),
        ("gateway_batched_over_direct", "gateway batched / direct (same B)"),
        ("gateway_batched_over_direct_at_effective_batch", "gateway batched / direct (effective B)"),
    )
    for ax, model in zip(axes[:, 0], models, strict=True):
        points = [p for p in report["table"] if p["model"] == model]
        xs = np.arange(len(points))
        for i, (key, label) in enumerate(bars):
            ax.bar(xs + (i - 1) * 0.27, [p[key] for p in points], 0.27, label=label)
        ax.axhline(0.9, color="black", linestyle="--", linewidth=0.8, label="target 0.9")
        ax.set_xticks(
            xs,
            [
                f"{p['runtime'].replace('openvino_', 'ov ').replace('onnxruntime', 'ort')}\n"
                f"B={p['rows_per_request']} c={p['concurrency']}"
                for p in points
            ],
            fontsize=7,
        )
        ax.set_ylim(0, 1.3)
        ax.set_title(f"{model}: gateway rows/s over direct rows/s (median of {report['rounds']} rounds)")
        ax.legend(fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    from bench import plotting  # bench/plotting.py: the footer with the date and machine
    plotting.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="measured seconds per point")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians are reported)")
    parser.add_argument("--model", choices=("digits", "cnn", "all"), default="all")
    parser.add_argument("--out", type=Path, default=RESULTS / "runtimes_gateway.json")
    args = parser.parse_args()
    started = time.perf_counter()
    load_before = os.getloadavg()
    table: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-rt-gw-") as tmp:
        for model, (onnx_path, xml, pool) in write_models(Path(tmp)).items():
            if args.model in (model, "all"):
                table += measure_model(Path(tmp), model, onnx_path, xml, pool, args.seconds, args.rounds)
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    kept = [p for p in previous.get("table", []) if p["model"] not in {q["model"] for q in table}]
    runs = {k: v for k, v in previous.get("runs", {}).items() if args.model != "all"}
    runs[args.model] = {
        "wall_s": round(time.perf_counter() - started, 1),
        "rounds": args.rounds,
        "seconds_per_point": args.seconds,
        "loadavg_before": [round(v, 2) for v in load_before],
        "loadavg_after": [round(v, 2) for v in os.getloadavg()],
    }
    report = {
        "benchmark": "bench_runtimes_gateway",
        "models": {
            "digits": "demo digits MLP 64-32-10, input [B, 64]",
            "cnn": f"ResNet-like CNN 3x64x64, widths {CNN_WIDTHS} (stem s2, 2 residual blocks, 2 maxpools, GAP, fc10), random weights",
        },
        "definition": "rows/s through the gateway over rows/s of the runtime called directly with the same rows per "
        "call and the same concurrency; the batched deployment is also compared with direct calls of its "
        "effective (mean merged) batch size from as many threads as it runs batches at once",
        "batching": {"max_batch_size": MAX_BATCH_ROWS, "max_delay_ms": 2},
        "rounds": args.rounds,
        "machine": {
            "cpu_count": os.cpu_count(),
            "note": "load generator, gateway and runtime share these cores with other work",
        },
        "versions": {
            "onnxruntime": ort.__version__,
            "openvino": ov.__version__,
            "python": platform.python_version(),
        },
        "runs": runs,
        "table": kept + table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    sys.stderr.write(f"wrote {args.out} in {runs[args.model]['wall_s']} s\n")


if __name__ == "__main__":
    main()
