"""The cost of tracing: the same gateway config with `tracing.enabled` off and on, side by side.

Three `fleetgate serve` processes serve the demo digits model (ONNX Runtime): tracing off, on for
every request, and on with `sample_ratio: 0.1`; the traced ones export over OTLP/HTTP to a local
sink that answers 200 (a collector that costs nothing). Closed
loop v2 `/infer` (binary tensors) at c=1 and c=16, interleaved rounds; medians. Target (issue 19):
tracing on keeps >= 95 % of the throughput.

Writes bench/results/tracing.json. Run: `.venv/bin/python bench/bench_tracing.py [--rounds 3]`.
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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench_gateway import _load, start_gateway, summarize, v2_request  # noqa: E402

RESULTS = ROOT / "bench" / "results"


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that accepts and drops every export."""

    received = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("content-length", 0)))
        type(self).received += 1
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from backends.demo_models.digits import digits_split, write_all

    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    row = np.ascontiguousarray(digits_split()[1][:1].astype(np.float32))
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        models = write_all(Path(tmp) / "models", savedmodel=False, llama=False)

        def config(tracing: bool, ratio: float = 1.0):  # noqa: ANN202
            def make(port: int) -> str:
                return f"""
server: {{port: {port}, log_level: warning}}
state: {{url: "memory://"}}
tenants: {{bench: {{}}}}
deployments: {{ort: {{backend: onnxruntime, model: {models["digits.onnx"]}}}}}
models: {{digits: {{routes: [{{deployment: ort}}]}}}}
tracing: {{enabled: {str(tracing).lower()}, sample_ratio: {ratio}, otlp_endpoint: "http://127.0.0.1:{sink.server_port}/v1/traces"}}
"""

            return make

        off = start_gateway(Path(tmp), config(False))
        on = start_gateway(Path(tmp), config(True))
        sampled = start_gateway(Path(tmp), config(True, 0.1))
        try:
            for _ in range(args.rounds):
                result = {}
                for name, (_proc, port, key) in (("off", off), ("on", on), ("on_sampled_10pct", sampled)):
                    request = v2_request("digits", row, key, port)
                    for c in (1, 16):
                        asyncio.run(_load(port, request, c, 0.3))
                        latencies, errors, elapsed = asyncio.run(_load(port, request, c, args.seconds))
                        result.setdefault(name, {})[f"c{c}"] = summarize(latencies, elapsed) | {
                            "errors": len(errors)
                        }
                rounds.append(result)
                print(json.dumps({k: {c: round(v["rps"]) for c, v in r.items()} for k, r in result.items()}))
        finally:
            for proc, _, _ in (off, on, sampled):
                proc.terminate()
                proc.wait(timeout=30)
    summary = {}
    for c in ("c1", "c16"):
        summary[c] = {"off_rps": statistics.median(r["off"][c]["rps"] for r in rounds)}
        for name in ("on", "on_sampled_10pct"):
            ratio = statistics.median(r[name][c]["rps"] / r["off"][c]["rps"] for r in rounds)
            summary[c][name] = {
                "rps": statistics.median(r[name][c]["rps"] for r in rounds),
                "over_off_rps": ratio,
                "p50_ms": statistics.median(r[name][c]["p50_ms"] for r in rounds),
                "meets_target_0_95": ratio >= 0.95,
            }
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": vars(args) | {"exports_received_by_sink": _Sink.received},
        "median": summary,
        "rounds": rounds,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tracing.json").write_text(json.dumps(out, indent=2))
    from plots import plot_tracing  # the PNG beside the JSON (bench/plots.py)

    plot_tracing(out, RESULTS / "tracing.png")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
