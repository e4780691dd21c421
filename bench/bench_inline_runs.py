"""Runtime calls on the event loop's thread vs handed to the runtime's threads (`inline_below_us`).

Two `fleetgate serve` processes serve the demo digits model (`--backend onnxruntime` or
`openvino`, reading the same .onnx; a run well under 200 us), one with the default `inline_below_us: 200` (its calls
run inline) and one with `inline_below_us: 0` (every call goes to a worker thread or, on OpenVINO,
to the async infer-request queue, as before the option existed). Interleaved rounds, the order
alternating, drive each over HTTP v2 (binary tensors) and gRPC `ModelInfer` with the clients of
bench_grpc.py, one row per request, closed loop at c=1 and c=16. Reported per server, protocol and
concurrency: requests/s, p50 and the gateway's CPU per request (user + system from /proc), medians of
rounds, and inline over worker ratios.

Writes bench/results/inline_runs.json (`inline_runs_openvino.json` for OpenVINO) and a PNG beside it.
Run: `.venv/bin/python -m bench.bench_inline_runs [--backend openvino]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path

import numpy as np

from bench.bench_gateway import start_gateway
from bench.bench_grpc import digits_config, free_port, run_grpc, run_http

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
MODES = {"inline": 200, "worker": 0}  # inline_below_us
CONCURRENCY = (1, 16)
PROTOCOLS = ("http", "grpc")
KEYS = ("rps", "p50_ms", "gateway_cpu_ms_per_request")


def plot(result: dict, out: Path) -> None:
    """The PNG of a result (this script's JSON, as written)."""
    summary = result["summary_median_of_rounds"]
    backend = result["config"].get("backend", "onnxruntime")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench import plotting  # bench/plotting.py: the footer with the date and machine

    cells = [(p, c) for p in PROTOCOLS for c in CONCURRENCY]
    xs = np.arange(len(cells))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in zip(
        axes,
        ("rps", "gateway_cpu_ms_per_request"),
        ("requests/s", "gateway CPU per request (ms)"),
        strict=True,
    ):
        for i, mode in enumerate(MODES):
            ax.bar(
                xs + (i - 0.5) * 0.35, [summary[f"{p}_c{c}"][mode][key] for p, c in cells], 0.35, label=mode
            )
        ax.set_xticks(xs, [f"{p}\nc={c}" for p, c in cells])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(
        f"digits on {backend}: calls inline on the event loop vs handed to the runtime's threads (medians)"
    )
    fig.tight_layout()
    plotting.save(fig, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=("onnxruntime", "openvino"), default="onnxruntime")
    args = parser.parse_args()
    from backends.demo_models.digits import digits_split, write_digits

    x = np.ascontiguousarray(digits_split()[1][:1].astype(np.float32))
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        digits = write_digits(Path(tmp))
        servers = {}
        for mode, below in MODES.items():
            grpc_port = free_port()
            proc, port, key = start_gateway(
                Path(tmp),
                digits_config(digits.onnx_path, grpc_port, {"inline_below_us": below}, args.backend),
            )
            servers[mode] = (proc, port, key, grpc_port)
        try:
            for r in range(args.rounds):
                result: dict = {}
                for mode in list(MODES) if r % 2 == 0 else list(MODES)[::-1]:
                    proc, port, key, grpc_port = servers[mode]
                    for c in CONCURRENCY:
                        result.setdefault(f"http_c{c}", {})[mode] = run_http(
                            port, key, x, c, args.seconds, proc.pid
                        )
                        result.setdefault(f"grpc_c{c}", {})[mode] = run_grpc(
                            f"127.0.0.1:{grpc_port}", key, x, c, args.seconds, proc.pid
                        )
                print(json.dumps({"round": r, **{cell: {m: [round(v[k], 3) for k in KEYS] for m, v in modes.items()}
                                                 for cell, modes in result.items()}}), flush=True)  # fmt: skip
                rounds.append(result)
        finally:
            for proc, *_ in servers.values():
                proc.terminate()
                proc.wait(timeout=30)

    summary: dict = {}
    for cell in rounds[0]:
        entry = {
            mode: {k: float(statistics.median(r[cell][mode][k] for r in rounds)) for k in KEYS}
            for mode in MODES
        }
        entry["inline_over_worker"] = {k: entry["inline"][k] / entry["worker"][k] for k in KEYS}
        summary[cell] = entry
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": {"seconds": args.seconds, "rounds": args.rounds, "inline_below_us": MODES},
        "summary_median_of_rounds": summary,
        "rounds": rounds,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "inline_runs" if args.backend == "onnxruntime" else f"inline_runs_{args.backend}"
    out["config"]["backend"] = args.backend
    (RESULTS / f"{stem}.json").write_text(json.dumps(out, indent=2))
    plot(out, RESULTS / f"{stem}.png")
    print(json.dumps({cell: e["inline_over_worker"] for cell, e in summary.items()}, indent=1))


if __name__ == "__main__":
    main()
