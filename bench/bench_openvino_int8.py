"""f32 vs INT8 (NNCF post-training quantization) OpenVINO IRs on CPU: accuracy and throughput.

Two models, both trained here on scikit-learn's digits (the same split): the demo digits MLP
(64 -> 32 -> 10, backends.demo_models.digits) and the small digits CNN (two 3x3 convolutions,
backends.demo_models.cnn). Each is written as an f32 IR and quantized to INT8 with
`backends.openvino.quantize.quantize_to_int8` on the training split (300 rows). Both IRs are
compiled as the openvino backend compiles them (CPU, LATENCY hint, INFERENCE_PRECISION_HINT f32,
which keeps f32 layers exact while quantized layers still run int8 kernels) and driven with one
synchronous infer request, so the numbers are the runtime's, without the gateway around it.

Measured, in one process and one run: top-1 accuracy on the held-out split (deterministic, once),
then `--rounds` rounds; a round measures every (model, precision, batch 1 / 64) point for
`--seconds`, in an order rotated per round. Reported: medians over rounds of rows/s and of the
per-call p50 latency, and the median of the per-round ratios int8/f32.

Two throughputs: `rows_per_s` (rows / wall time, what a saturated caller gets) and
`rows_per_s_at_p50` (batch / median call time). On a shared machine the first drops whenever a
neighbour takes a core; the second barely moves, so compare ratios of both.

    .venv/bin/python -m bench.bench_openvino_int8 [--seconds 1 --rounds 5]

Writes bench/results/openvino_int8.json and bench/results/openvino_int8.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from backends.demo_models.cnn import as_images, write_digits_cnn
from backends.demo_models.digits import digits_split, write_digits
from backends.demo_models.exports import write_openvino_ir
from backends.openvino.quantize import quantize_to_int8, quantized_op_counts
from fleetgate.host import cpu_model

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
BATCHES = (1, 64)
PRECISIONS = ("f32", "int8")
#: what the openvino backend passes by default (backends/openvino/backend.py)
COMPILE_CONFIG = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
#: runtime layers that carry int8 data without computing on it
_NOT_COMPUTE = ("Const", "Reorder", "Reshape")


def build_models(work: Path) -> dict[str, dict[str, Any]]:
    """model -> {f32, int8 IR paths, test rows and labels}."""
    x_train, x_test, _, y_test = digits_split()
    mlp_f32 = write_openvino_ir(write_digits(work).onnx_path, work / "digits.xml")
    cnn = write_digits_cnn(work)
    cnn_f32 = write_openvino_ir(cnn.onnx_path, work / "digits_cnn.xml")
    return {
        "mlp": {
            "f32": mlp_f32,
            "int8": quantize_to_int8(mlp_f32, x_train, work / "digits_int8.xml"),
            "x_test": x_test,
            "y_test": y_test,
        },
        "cnn": {
            "f32": cnn_f32,
            "int8": quantize_to_int8(cnn_f32, as_images(x_train), work / "digits_cnn_int8.xml"),
            "x_test": as_images(x_test),
            "y_test": y_test,
        },
    }


def int8_layers(compiled: Any) -> list[str]:
    """The compiled model's layers that the CPU plugin runs in u8/i8 (proof the int8 kernels run)."""
    found = []
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        kind = info["layerType"].astype(str)
        if info["runtimePrecision"].astype(str) in ("u8", "i8") and kind not in _NOT_COMPUTE:
            found.append(kind)
    return found


def measure(request: Any, batches: list[np.ndarray], seconds: float) -> dict[str, float]:
    """Back-to-back synchronous inferences for `seconds` (after a short warm-up)."""
    for b in batches[:4]:
        request.infer({0: b}, share_inputs=True)
    calls: list[float] = []
    rows = 0
    start = time.perf_counter()
    stop = start + seconds
    i = 0
    while time.perf_counter() < stop:
        b = batches[i % len(batches)]
        t0 = time.perf_counter()
        request.infer({0: b}, share_inputs=True)
        calls.append(time.perf_counter() - t0)
        rows += len(b)
        i += 1
    elapsed = time.perf_counter() - start
    return {
        "rows_per_s": rows / elapsed,
        "rows_per_s_at_p50": len(batches[0]) / float(np.percentile(calls, 50)),
        "p50_ms": float(np.percentile(calls, 50)) * 1e3,
        "calls": len(calls),
    }


def run(seconds: float, rounds: int, threads: int | None) -> dict[str, Any]:
    import openvino as ov

    core = ov.Core()
    config = dict(COMPILE_CONFIG, **({"INFERENCE_NUM_THREADS": threads} if threads else {}))
    load_at_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-ov-int8-") as tmp:
        models = build_models(Path(tmp))
        compiled: dict[tuple[str, str], Any] = {}
        info: dict[str, dict[str, Any]] = {}
        for name, m in models.items():
            info[name] = {}
            for precision in PRECISIONS:
                c = core.compile_model(str(m[precision]), "CPU", config)
                compiled[(name, precision)] = c
                probabilities = c({0: m["x_test"]})[0]
                info[name][precision] = {
                    "top1": round(float((probabilities.argmax(axis=1) == m["y_test"]).mean()), 4),
                    "bin_bytes": Path(m[precision]).with_suffix(".bin").stat().st_size,
                    "ops": quantized_op_counts(m[precision]),
                    "int8_layers": int8_layers(c),
                }
        points = [(n, p, b) for n in models for b in BATCHES for p in PRECISIONS]
        per_round: list[dict[str, dict[str, Any]]] = []
        for r in range(rounds):
            shift = (r * 3) % len(points)
            this: dict[str, dict[str, Any]] = {}
            for name, precision, batch in points[shift:] + points[:shift]:
                x = models[name]["x_test"]
                batches = [x[i : i + batch] for i in range(0, batch * 8, batch)]
                request = compiled[(name, precision)].create_infer_request()
                result = measure(request, batches, seconds)
                this.setdefault(f"{name}/b{batch}", {})[precision] = result
                print(
                    f"round {r} {name:4s} b{batch:<3d} {precision:5s} {result['rows_per_s']:11.0f} rows/s "
                    f"p50 {result['p50_ms']:.4f} ms",
                    flush=True,
                )
            per_round.append(this)
    report = summarize(per_round, info)
    report.update(seconds_per_point=seconds, rounds=rounds, compile_config=config)
    report["machine"]["loadavg_at_start"] = load_at_start
    return report


def summarize(per_round: list[dict[str, dict[str, Any]]], info: dict) -> dict:
    points: dict[str, dict[str, Any]] = {}
    for key in per_round[0]:
        entry: dict[str, Any] = {}
        for precision in PRECISIONS:
            entry[precision] = {
                metric: round(statistics.median(r[key][precision][metric] for r in per_round), 4)
                for metric in ("rows_per_s", "rows_per_s_at_p50", "p50_ms")
            }
        for metric in ("rows_per_s", "rows_per_s_at_p50"):
            ratios = [r[key]["int8"][metric] / r[key]["f32"][metric] for r in per_round]
            entry[f"ratio_int8_over_f32_{metric}"] = {
                "median": round(statistics.median(ratios), 3),
                "per_round": [round(x, 3) for x in ratios],
            }
        points[key] = entry
    import nncf
    import openvino as ov

    return {
        "benchmark": "bench_openvino_int8",
        "what": (__doc__ or "").split("\n\n")[0],
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "versions": {
            "openvino": ov.__version__,
            "nncf": nncf.__version__,
            "python": platform.python_version(),
        },
        "models": info,
        "points": points,
        "per_round": per_round,
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    width = 0.38
    for ax, batch in zip(axes[:2], BATCHES, strict=True):
        points = [report["points"][f"{m}/b{batch}"] for m in models]
        for i, precision in enumerate(PRECISIONS):
            bars = ax.bar(
                [j + i * width for j in range(len(models))],
                [p[precision]["rows_per_s_at_p50"] for p in points],
                width,
                label=precision,
            )
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
        labels = [
            f"{m}\nint8/f32: {p['ratio_int8_over_f32_rows_per_s_at_p50']['median']:.2f} "
            f"(wall: {p['ratio_int8_over_f32_rows_per_s']['median']:.2f})"
            for m, p in zip(models, points, strict=True)
        ]
        ax.set_xticks([j + width / 2 for j in range(len(models))], labels, fontsize=8)
        ax.set(title=f"rows/s at batch {batch} = batch / p50 call (medians over rounds)")
        ax.title.set_fontsize(10)
        ax.legend(fontsize=8)
    ax = axes[2]
    for i, precision in enumerate(PRECISIONS):
        values = [report["models"][m][precision]["top1"] * 100 for m in models]
        bars = ax.bar([j + i * width for j in range(len(models))], values, width, label=precision)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks([j + width / 2 for j in range(len(models))], models)
    ax.set(title="top-1 accuracy on the held-out split (%)", ylim=(90, 100))
    ax.legend(fontsize=8, loc="lower right")
    threads = report["compile_config"].get("INFERENCE_NUM_THREADS", "default")
    fig.suptitle(
        f"OpenVINO on CPU, f32 vs INT8 IR (NNCF PTQ), LATENCY hint, threads {threads} - "
        f"{report['machine']['cpu']}, {report['machine']['cores']} cores",
        fontsize=10,
    )
    fig.tight_layout()
    from bench import plotting  # bench/plotting.py: the footer with the date and machine
    plotting.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="measured seconds per point and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, help="INFERENCE_NUM_THREADS (default: OpenVINO's choice)")
    parser.add_argument("--out", type=Path, default=RESULTS / "openvino_int8.json")
    args = parser.parse_args()
    report = run(args.seconds, args.rounds, args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    summary = {
        "top1": {m: {p: v[p]["top1"] for p in PRECISIONS} for m, v in report["models"].items()},
        "points": {
            k: {
                **{f"{p}_{m}": v[p][m] for p in PRECISIONS for m in ("rows_per_s", "rows_per_s_at_p50")},
                "ratio_wall": v["ratio_int8_over_f32_rows_per_s"]["median"],
                "ratio_p50": v["ratio_int8_over_f32_rows_per_s_at_p50"]["median"],
            }
            for k, v in report["points"].items()
        },
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
