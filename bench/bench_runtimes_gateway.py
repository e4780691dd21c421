"""ONNX Runtime and OpenVINO, direct and through the gateway, batched and unbatched, in one run.

Two models, each as ONNX and as OpenVINO IR (f32):
  - digits: the demo MLP 64-32-10 (`gateway.demo_models.write_digits`), one row per request;
  - cnn: a ResNet-like CNN on 3x64x64 inputs with random weights (~0.85 GFLOP per row), built here.
Three runtimes per model: onnxruntime (CPU provider), openvino with the LATENCY hint, openvino with the
THROUGHPUT hint. Three ways to call each, at concurrency 1 and 16, every request one row:
  - direct: the runtime's own Python API in `c` threads (`session.run`; one infer request per thread
    on a model compiled with the adapter's hint and f32 precision);
  - gateway unbatched / batched: the v2 `/infer` endpoint of a `fleetgate serve` subprocess, one
    deployment per runtime/hint, with and without `batching: {max_batch_size: 32, max_delay_ms: 2}`,
    driven by bench_gateway's keep-alive client with the binary tensor extension.
For each (model, runtime, concurrency) the three points run back to back, so the ratios gateway/direct
(target >= 0.9 at the same batch size, one row per request) and batched/unbatched compare like with like
on a machine whose load changes. The load generator shares the CPU with the server and the runtime.

Writes bench/results/runtimes_gateway.json (+ .png).
Run: `.venv/bin/python bench/bench_runtimes_gateway.py [--seconds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
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

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench_gateway import _load, start_gateway, summarize, v2_request  # noqa: E402

from backends.model_exports import write_openvino_ir  # noqa: E402
from gateway.demo_models import write_digits  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CONCURRENCY = (1, 16)
RUNTIMES = ("onnxruntime", "openvino_latency", "openvino_throughput")
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
    """name -> (onnx path, IR xml path, one input row of shape [1, ...])."""
    rng = np.random.default_rng(1)
    digits = write_digits(tmp)
    cnn = tmp / "cnn.onnx"
    build_cnn(cnn)
    rows = {
        "digits": rng.integers(0, 17, (1, 64)).astype(np.float32),
        "cnn": rng.standard_normal((1, 3, 64, 64), np.float32),
    }
    onnx_paths = {"digits": digits.onnx_path, "cnn": cnn}
    return {n: (p, write_openvino_ir(p, tmp / f"{n}.xml"), rows[n]) for n, p in onnx_paths.items()}


# --- direct --------------------------------------------------------------------------------------


def direct_callers(
    runtime: str, onnx_path: Path, xml: Path, row: np.ndarray
) -> Callable[[], Callable[[], object]]:
    """A factory of per-thread callables, each running one inference on `row` with the runtime's own API."""
    if runtime == "onnxruntime":
        opts = ort.SessionOptions()
        session = ort.InferenceSession(str(onnx_path), sess_options=opts, providers=["CPUExecutionProvider"])
        return lambda: lambda: session.run(None, {"input": row})
    hint = "LATENCY" if runtime == "openvino_latency" else "THROUGHPUT"
    # the same compile config as backends/openvino.py with `performance_hint: <hint>` and default precision
    compiled = ov.Core().compile_model(
        str(xml), "CPU", {"PERFORMANCE_HINT": hint, "INFERENCE_PRECISION_HINT": "f32"}
    )

    def per_thread() -> Callable[[], object]:
        request = compiled.create_infer_request()  # infer requests are not thread-safe: one per thread
        return lambda: request.infer({0: row})

    return per_thread


def _threads(
    factory: Callable[[], Callable[[], object]], concurrency: int, seconds: float
) -> tuple[list[float], float]:
    calls = [factory() for _ in range(concurrency)]
    per_thread: list[list[float]] = [[] for _ in range(concurrency)]
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


def run_direct(
    factory: Callable[[], Callable[[], object]], concurrency: int, seconds: float
) -> dict[str, float]:
    _threads(factory, concurrency, 0.5)  # warm-up
    cpu0 = process_cpu_s()
    latencies, elapsed = _threads(factory, concurrency, seconds)
    cpu = process_cpu_s() - cpu0
    return {**summarize(latencies, elapsed), "cpu_ms_per_request": 1000 * cpu / max(1, len(latencies))}


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
            batching = ", batching: {max_batch_size: 32, max_delay_ms: 2}" if batched else ""
            lines.append(f"  {name}: {{{body}{batching}, queue: {{max_concurrency: 64}}}}")
    lines.append("models:")
    lines += [f"  {n}: {{routes: [{{deployment: {n}}}]}}" for n in names]
    return "\n".join(lines) + "\n"


def run_gateway(pid: int, port: int, request: bytes, concurrency: int, seconds: float) -> dict[str, float]:
    """Closed-loop load on the gateway; also the CPU the server and this load generator spent per request."""
    asyncio.run(_load(port, request, concurrency, 0.5))  # warm-up (and batcher/threads spun up)
    client0, server0 = process_cpu_s(), process_cpu_s(pid)
    latencies, errors, elapsed = asyncio.run(_load(port, request, concurrency, seconds))
    n = max(1, len(latencies))
    return {
        **summarize(latencies, elapsed),
        "errors": len(errors),
        "server_cpu_ms_per_request": 1000 * (process_cpu_s(pid) - server0) / n,
        "client_cpu_ms_per_request": 1000 * (process_cpu_s() - client0) / n,
    }


# --- one run -------------------------------------------------------------------------------------


def measure_model(
    tmp: Path, model: str, onnx_path: Path, xml: Path, row: np.ndarray, seconds: float
) -> tuple[list[dict], list[dict]]:
    proc, port, key = start_gateway(tmp, lambda port: gateway_config(port, model, onnx_path, xml))
    points: list[dict] = []
    ratios: list[dict] = []
    try:
        for runtime in RUNTIMES:
            factory = direct_callers(runtime, onnx_path, xml, row)
            for c in CONCURRENCY:
                # the three ways back to back, so their ratios see the same background load
                by_mode = {"direct": run_direct(factory, c, seconds)}
                for batched in (False, True):
                    request = v2_request(deployment_name(model, runtime, batched), row, key, port)
                    mode = "gateway_batched" if batched else "gateway_unbatched"
                    by_mode[mode] = run_gateway(proc.pid, port, request, c, seconds)
                for mode, r in by_mode.items():
                    points.append({"model": model, "runtime": runtime, "mode": mode, "concurrency": c, **r})
                    log_point(points[-1])
                d, u, b = (by_mode[m]["rps"] for m in ("direct", "gateway_unbatched", "gateway_batched"))
                ratios.append(
                    {
                        "model": model,
                        "runtime": runtime,
                        "concurrency": c,
                        "gateway_unbatched_over_direct": round(u / d, 3),
                        "gateway_batched_over_direct": round(b / d, 3),
                        "batched_over_unbatched": round(b / u, 3),
                    }
                )
                sys.stderr.write(json.dumps(ratios[-1]) + "\n")
            del factory
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return points, ratios


def log_point(p: dict) -> None:
    sys.stderr.write(
        f"{p['model']:6s} {p['runtime']:19s} {p['mode']:17s} c={p['concurrency']:<2d} "
        f"rps={p['rps']:8.1f} p50={p['p50_ms']:7.3f}ms p99={p['p99_ms']:8.3f}ms errors={p.get('errors', 0)} "
        f"cpu_ms/req={p.get('cpu_ms_per_request', p.get('server_cpu_ms_per_request', 0)):.3f}"
        f"+{p.get('client_cpu_ms_per_request', 0):.3f}\n"
    )


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = ("direct", "gateway_unbatched", "gateway_batched")
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, model in zip(axes, ("digits", "cnn"), strict=True):
        groups = [(r, c) for r in RUNTIMES for c in CONCURRENCY]
        xs = np.arange(len(groups))
        for i, mode in enumerate(modes):
            rps = [
                next(
                    p["rps"]
                    for p in report["points"]
                    if (p["model"], p["runtime"], p["concurrency"], p["mode"]) == (model, r, c, mode)
                )
                for r, c in groups
            ]
            ax.bar(xs + (i - 1) * 0.27, rps, 0.27, label=mode)
        ax.set_xticks(xs, [f"{r.replace('openvino_', 'ov ')}\nc={c}" for r, c in groups], fontsize=8)
        ax.set_title(f"{model}: requests/s, one row per request")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per point")
    parser.add_argument("--out", type=Path, default=RESULTS / "runtimes_gateway.json")
    args = parser.parse_args()
    started = time.perf_counter()
    load_before = os.getloadavg()
    points: list[dict] = []
    ratios: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-rt-gw-") as tmp:
        for model, (onnx_path, xml, row) in write_models(Path(tmp)).items():
            p, r = measure_model(Path(tmp), model, onnx_path, xml, row, args.seconds)
            points += p
            ratios += r
    for p in points:
        for k, v in p.items():
            if isinstance(v, float):
                p[k] = round(v, 1 if k == "rps" else 3)
    report = {
        "benchmark": "bench_runtimes_gateway",
        "models": {
            "digits": "demo digits MLP 64-32-10, input [1, 64]",
            "cnn": f"ResNet-like CNN 3x64x64, widths {CNN_WIDTHS} (stem s2, 2 residual blocks, 2 maxpools, GAP, fc10), random weights",
        },
        "request": "one row per request everywhere; gateway batching merges rows server-side (max 32, 2 ms)",
        "seconds_per_point": args.seconds,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": {
            "cpu_count": os.cpu_count(),
            "loadavg_before": [round(v, 2) for v in load_before],
            "loadavg_after": [round(v, 2) for v in os.getloadavg()],
            "note": "load generator, gateway and runtime share these cores with other work",
        },
        "versions": {
            "onnxruntime": ort.__version__,
            "openvino": ov.__version__,
            "python": platform.python_version(),
        },
        "points": points,
        "ratios": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    sys.stderr.write(f"wrote {args.out} in {report['wall_s']} s\n")


if __name__ == "__main__":
    main()
