"""One model, every runtime: the demo digits model on ONNX Runtime, OpenVINO and TF Serving.

All backends are driven through their fleetgate adapters (the same `infer()` the gateway calls), in
one process, one after another, in one run, so the ratios are comparable on a shared machine:
  - onnxruntime (CPUExecutionProvider)
  - openvino with the LATENCY hint and with the THROUGHPUT hint (f32)
  - tfserving against `tests/tfserving_server.py` (TensorFlow executing the SavedModel in a
    subprocess; no real TF Serving binary exists on these machines)
  - onnxruntime and openvino THROUGHPUT behind the dynamic batcher (concurrency 16 only)
Each request carries one row; closed-loop clients at concurrency 1 and 16. Before timing, every
backend classifies the whole digits test split, so accuracy and the max abs difference against
ONNX Runtime are in the same JSON.

Writes bench/results/runtimes.json. Run: `.venv/bin/python -m bench.bench_runtimes [--seconds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TF_ENV = {"CUDA_VISIBLE_DEVICES": "-1", "TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "3"}
os.environ.update(TF_ENV)

from backends import onnxruntime as ort_backend  # noqa: E402
from backends import openvino as ov_backend  # noqa: E402
from backends import tfserving as tfs_backend  # noqa: E402
from backends.base import Tensor, TensorRequest  # noqa: E402
from backends.demo_models.digits import digits_split, write_digits  # noqa: E402
from backends.demo_models.exports import write_openvino_ir, write_tf_savedmodel  # noqa: E402
from backends.spec import BatchingSpec, DeploymentSpec  # noqa: E402
from fleetgate.host import cpu_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CONCURRENCY = (1, 16)
BATCHING = BatchingSpec(max_batch_size=32, max_delay_ms=2.0)


def start_tf_server(model_base: Path) -> tuple[subprocess.Popen, str]:
    """The PredictionService test server in a subprocess; returns it and its host:port."""
    server = ROOT / "tests" / "tfserving_server.py"
    proc = subprocess.Popen(
        [sys.executable, str(server), "--model-name", "digits", "--model-base-path", str(model_base)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **TF_ENV},
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("LISTENING "):
        proc.kill()
        raise SystemExit("the TF Serving test server did not start")
    return proc, f"127.0.0.1:{int(line.split()[1])}"


def deployments(models: Path, target: str) -> dict[str, tuple[object, DeploymentSpec, tuple[int, ...]]]:
    """name -> (adapter module, spec, concurrencies to measure)."""
    onnx = str(models / "digits.onnx")
    xml = str(models / "digits.xml")
    return {
        "onnxruntime": (ort_backend, DeploymentSpec(backend="onnxruntime", model=onnx), CONCURRENCY),
        "openvino_latency": (
            ov_backend,
            DeploymentSpec(backend="openvino", model=xml, options={"performance_hint": "LATENCY"}),
            CONCURRENCY,
        ),
        "openvino_throughput": (
            ov_backend,
            DeploymentSpec(backend="openvino", model=xml, options={"performance_hint": "THROUGHPUT"}),
            CONCURRENCY,
        ),
        "tfserving_testserver": (
            tfs_backend,
            DeploymentSpec(backend="tfserving", target=target, model_name="digits"),
            CONCURRENCY,
        ),
        "onnxruntime+batching": (
            ort_backend,
            DeploymentSpec(backend="onnxruntime", model=onnx, batching=BATCHING),
            (16,),
        ),
        "openvino_throughput+batching": (
            ov_backend,
            DeploymentSpec(
                backend="openvino", model=xml, options={"performance_hint": "THROUGHPUT"}, batching=BATCHING
            ),
            (16,),
        ),
    }


async def classify(backend, x: np.ndarray) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    response = await backend.infer(TensorRequest(id="all", inputs=[Tensor.from_array("input", x)]))
    return {t.name: t.data for t in response.outputs}


async def closed_loop(backend, x: np.ndarray, concurrency: int, seconds: float) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """`concurrency` clients, each sending one-row requests back to back for `seconds`."""
    latencies: list[float] = []
    stop_at = time.perf_counter() + min(0.5, seconds)  # warm-up; the clients read stop_at as it changes

    async def client(worker: int) -> None:
        i = worker
        while time.perf_counter() < stop_at:
            row = x[i % len(x) : i % len(x) + 1]
            i += concurrency
            t0 = time.perf_counter()
            await backend.infer(TensorRequest(id=str(i), inputs=[Tensor.from_array("input", row)]))
            latencies.append(time.perf_counter() - t0)

    await asyncio.gather(*(client(w) for w in range(concurrency)))  # warm-up pass
    latencies.clear()
    stop_at = time.perf_counter() + seconds
    start = time.perf_counter()
    await asyncio.gather(*(client(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - start
    ms = np.asarray(latencies) * 1000.0
    return {
        "requests": len(latencies),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
    }


async def run(seconds: float) -> dict:
    import onnxruntime as ort
    import openvino as ov

    with tempfile.TemporaryDirectory(prefix="bench-runtimes-") as tmp:
        models = Path(tmp)
        digits = write_digits(models)
        write_openvino_ir(digits.onnx_path, models / "digits.xml")
        write_tf_savedmodel(digits.weights_path, models / "digits_tf" / "1")
        _, x_test, _, y_test = digits_split()
        session = ort.InferenceSession(str(digits.onnx_path), providers=["CPUExecutionProvider"])
        ref_probs = session.run(["probabilities"], {"input": x_test})[0]
        proc, target = start_tf_server(models / "digits_tf")
        results: dict[str, dict] = {}
        try:
            for name, (module, spec, concurrencies) in deployments(models, target).items():
                backend = module.create(f"digits-{name}", spec)  # type: ignore[attr-defined]
                await backend.load()
                await backend.warmup()
                out = await classify(backend, x_test)
                entry: dict = {
                    "accuracy": round(float((out["label"] == y_test).mean()), 4),
                    "max_abs_diff_vs_onnxruntime": float(np.abs(out["probabilities"] - ref_probs).max()),
                    "device": backend.metadata().device,
                    "extra": {k: v for k, v in backend.metadata().extra.items() if k != "model_file"},
                }
                for c in concurrencies:
                    entry[f"concurrency_{c}"] = await closed_loop(backend, x_test, c, seconds)
                await backend.close()
                results[name] = entry
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    return {
        "benchmark": "bench_runtimes",
        "model": "demo digits MLP 64-32-10 (backends.demo_models.digits), one row per request",
        "seconds_per_point": seconds,
        "test_rows": int(len(y_test)),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count()},
        "versions": {
            "onnxruntime": ort.__version__,
            "openvino": ov.__version__,
            "python": platform.python_version(),
        },
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per point")
    parser.add_argument("--out", type=Path, default=RESULTS / "runtimes.json")
    args = parser.parse_args()
    report = asyncio.run(run(args.seconds))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    from bench.plots import plot_runtimes  # the PNG beside the JSON (bench/plots.py)

    plot_runtimes(report, args.out.with_suffix(".png"))
    sys.stdout.write(json.dumps(report["results"], indent=1) + "\n")


if __name__ == "__main__":
    main()
