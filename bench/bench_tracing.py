"""The cost of tracing through the OpenTelemetry SDK: one gateway serving with `tracing` off and on,
switched by config reloads.

One `fleetgate serve` process serves the demo digits model (ONNX Runtime); between measurements a
config reload (`POST /admin/reload`) turns tracing off, on for every request, or on with
`sample_ratio: 0.1`, and `off_again` measures the untraced gateway a second time within the round
(the noise floor the ratios must be read against). One process for every variant on purpose: two
identical gateway processes measured side by side on this machine differed by 2-8 % (heap and code
layout, which core each landed on), more than the effect measured here. The traced states are the
SDK's spans (a root span and one per backend attempt; `--step-spans` adds the gateway's step spans),
sent by its BatchSpanProcessor and OTLP/HTTP exporter to a collector stand-in in its own process (it
keeps what it receives and, at the end, decodes it with the `opentelemetry-proto` classes to count
the spans). Closed-loop v2 `/infer`
(binary tensors) at c=1 and c=16; rounds visit the states in the orders of a balanced Latin square
(Williams design: over every 4 rounds each state takes each position once and follows each other
state once; a plain rotation keeps each state's predecessor the same in every round, and at the last
rotated run the two untraced measurements differed by 5-6 %, more than the target allows); medians
of rounds. Reported: requests/s, p50, and the gateway's CPU per request (user + system from /proc).
Target: tracing on keeps >= 95 % of the throughput.

`--paired` measures the same question a second way, made for a machine whose speed drifts within
seconds (the untraced state measured twice in one round differed by up to 40 % on some days): two
gateways are loaded at the same moment by one client, one traced and one not, then the roles are
swapped by reloads. Both halves share whatever the machine does meanwhile, and a process's own
speed (heap and code layout) cancels in the round's estimate sqrt((A_on / B_off) * (B_on / A_off)).
Competing for the same cores, a gateway that spends more CPU a request answers fewer of them, so the
estimate is the throughput ratio the target is about. Written under `paired` in the same JSON.

Writes bench/results/tracing.json. Run: `.venv/bin/python -m bench.bench_tracing [--rounds 8]` (a multiple of 4)
`[--paired-rounds 16]` (0: the sequential design only) `[--step-spans]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.bench_gateway import ADMIN_KEY, _load, start_gateway, summarize, v2_request
from bench.bench_http_stack import cpu_seconds

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that keeps every export; GET answers how many spans they held."""

    protocol_version = "HTTP/1.1"  # keep-alive, as a real collector
    bodies: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        type(self).bodies.append(self.rfile.read(int(self.headers.get("content-length", 0))))
        self._answer(b"", "application/x-protobuf")

    def do_GET(self) -> None:  # noqa: N802
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        spans = 0
        for body in type(self).bodies:
            for resource in ExportTraceServiceRequest.FromString(body).resource_spans:
                spans += sum(len(scope.spans) for scope in resource.scope_spans)
        self._answer(
            json.dumps({"exports": len(type(self).bodies), "spans": spans}).encode(), "application/json"
        )

    def _answer(self, body: bytes, kind: str) -> None:
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


def run_collector() -> None:
    """The collector stand-in (`--collector`): prints its port, serves until killed."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    print(server.server_port, flush=True)
    server.serve_forever()


def williams_order(names: list[str], index: int) -> list[str]:
    """Round `index`'s order of the states (an even number of them): row `index % n` of a balanced
    Latin square, whose n rows put each state in each position once and right after each other
    state once, so neither position nor predecessor favours a state."""
    n = len(names)
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]  # 0, 1, n-1, 2, ...
    return [names[(i + index) % n] for i in first]


def summarize_rounds(rounds: list[dict], names: list[str]) -> dict:
    """Medians over rounds, per concurrency: each state's requests/s and CPU per request against
    the first untraced measurement's, and against the mean of both untraced ones in the round."""
    summary: dict = {}
    for c in ("c1", "c16"):
        summary[c] = {
            "off_rps": statistics.median(r["off"][c]["rps"] for r in rounds),
            "off_cpu_ms_per_request": statistics.median(
                r["off"][c]["gateway_cpu_ms_per_request"] for r in rounds
            ),
        }
        for name in names[1:]:
            ratio = statistics.median(r[name][c]["rps"] / r["off"][c]["rps"] for r in rounds)
            cpu_ratio = statistics.median(
                r[name][c]["gateway_cpu_ms_per_request"] / r["off"][c]["gateway_cpu_ms_per_request"]
                for r in rounds
            )
            over_both = statistics.median(
                r[name][c]["rps"] / ((r["off"][c]["rps"] + r["off_again"][c]["rps"]) / 2) for r in rounds
            )
            summary[c][name] = {
                "rps": statistics.median(r[name][c]["rps"] for r in rounds),
                "over_off_rps": ratio,
                "over_both_untraced_rps": over_both,
                "p50_ms": statistics.median(r[name][c]["p50_ms"] for r in rounds),
                "cpu_ms_per_request": statistics.median(
                    r[name][c]["gateway_cpu_ms_per_request"] for r in rounds
                ),
                "cpu_over_off": cpu_ratio,
                "meets_target_0_95": ratio >= 0.95,
            }
    return summary


def _reload(port: int, config_path: Path, text: str) -> None:
    """Serve `text` as the gateway's config, through its admin reload (as an operator would)."""
    config_path.write_text(text)
    answer = httpx.post(
        f"http://127.0.0.1:{port}/admin/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60
    )
    answer.raise_for_status()


async def _load_both(requests: list[tuple[int, bytes]], concurrency: int, seconds: float) -> list[tuple]:
    """Both gateways under the same closed-loop load at the same moment."""
    return await asyncio.gather(*(_load(port, request, concurrency, seconds) for port, request in requests))


def paired_rounds(
    args: argparse.Namespace, tmp: Path, config: Any, states: dict[str, str], row: np.ndarray
) -> dict:
    """The paired design (module docstring): two gateways, one traced, loaded together; roles swapped."""
    gateways = []  # (process, port, config path, request)
    for _ in range(2):
        proc, port, key = start_gateway(tmp, config(states["off"]))
        gateways.append((proc, port, tmp / f"gateway-{port}.yaml", v2_request("digits", row, key, port)))
    requests = [(port, request) for _, port, _, request in gateways]
    rounds: list[dict] = []
    traced_requests = 0  # answered by a traced gateway: the collector should hold 2 spans for each (6 with --step-spans)
    try:
        for index in range(args.paired_rounds):
            result: dict[str, dict] = {}
            for traced in (0, 1) if index % 2 == 0 else (1, 0):
                for which, (_, port, path, _) in enumerate(gateways):
                    _reload(port, path, config(states["on" if which == traced else "off"])(port))
                for c in (1, 16):
                    warm = asyncio.run(_load_both(requests, c, args.warmup))
                    traced_requests += len(warm[traced][0])
                    cpu0 = [cpu_seconds(g[0].pid) for g in gateways]
                    loads = asyncio.run(_load_both(requests, c, args.seconds))
                    cpu1 = [cpu_seconds(g[0].pid) for g in gateways]
                    half = {}
                    traced_requests += len(loads[traced][0])
                    for which, (latencies, errors, elapsed) in enumerate(loads):
                        half["on" if which == traced else "off"] = summarize(latencies, elapsed) | {
                            "errors": len(errors),
                            "gateway": "ab"[which],
                            "gateway_cpu_ms_per_request": (cpu1[which] - cpu0[which])
                            * 1000
                            / max(len(latencies), 1),
                        }
                    result.setdefault(f"{'ab'[traced]}_traced", {})[f"c{c}"] = half
            rounds.append(result)
            print(
                json.dumps(
                    {
                        "paired": {
                            h: {c: round(v["on"]["rps"] / v["off"]["rps"], 3) for c, v in r.items()}
                            for h, r in result.items()
                        }
                    }
                )
            )
    finally:
        for proc, *_ in gateways:
            proc.terminate()
            proc.wait(timeout=30)
    summary: dict = {}
    for c in ("c1", "c16"):

        def estimate(key: str, r: dict, c: str = c) -> float:
            a, b = r["a_traced"][c], r["b_traced"][c]
            return math.sqrt((a["on"][key] / a["off"][key]) * (b["on"][key] / b["off"][key]))

        ratios = [estimate("rps", r) for r in rounds]
        cpu = [estimate("gateway_cpu_ms_per_request", r) for r in rounds]
        summary[c] = {
            "on_over_off_rps": statistics.median(ratios),
            "rounds_on_over_off_rps": ratios,
            "cpu_per_request_on_over_off": statistics.median(cpu),
            "off_rps": statistics.median(r[h][c]["off"]["rps"] for r in rounds for h in r),
            "on_rps": statistics.median(r[h][c]["on"]["rps"] for r in rounds for h in r),
            "meets_target_0_95": statistics.median(ratios) >= 0.95,
        }
    return {"rounds": rounds, "median": summary, "traced_requests": traced_requests}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    # a multiple of the 4 orders of the Latin square keeps positions and predecessors balanced
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=float, default=1.5, help="seconds of load before each measurement")
    parser.add_argument("--paired-rounds", type=int, default=16, help="rounds of the paired design (0: none)")
    parser.add_argument(
        "--step-spans", action="store_true", help="traced states also make the step spans (tracing.step_spans)"
    )
    parser.add_argument("--collector", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.collector:
        return run_collector()
    from backends.demo_models.digits import digits_split, write_all

    collector = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_tracing", "--collector"], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    collector_port = int(collector.stdout.readline())
    row = np.ascontiguousarray(digits_split()[1][:1].astype(np.float32))
    rounds: list[dict] = []
    # each state's `tracing:` settings; `off_again` is the untraced state measured a second time
    states = {
        "off": "enabled: false",
        "off_again": "enabled: false",
        "on": "enabled: true, sample_ratio: 1.0",
        "on_sampled_10pct": "enabled: true, sample_ratio: 0.1",
    }
    if args.step_spans:
        states = {name: f"{value}, step_spans: true" if name.startswith("on") else value for name, value in states.items()}
    served = {name: 0 for name in states if name.startswith("on")}
    with tempfile.TemporaryDirectory() as tmp:
        models = write_all(Path(tmp) / "models", savedmodel=False, llama=False)

        def config(tracing: str):  # noqa: ANN202
            def make(port: int) -> str:
                return f"""
server: {{port: {port}, log_level: warning}}
state: {{url: "memory://"}}
tenants: {{bench: {{}}}}
deployments: {{ort: {{backend: onnxruntime, model: {models["digits.onnx"]}}}}}
models: {{digits: {{routes: [{{deployment: ort}}]}}}}
tracing: {{{tracing}, otlp_endpoint: "http://127.0.0.1:{collector_port}/v1/traces"}}
"""

            return make

        paired = paired_rounds(args, Path(tmp), config, states, row) if args.paired_rounds else None
        proc, port, key = start_gateway(Path(tmp), config(states["off"]))
        config_path = Path(tmp) / f"gateway-{port}.yaml"
        request = v2_request("digits", row, key, port)
        names = list(states)
        try:
            for index in range(args.rounds):
                result: dict[str, dict] = {}
                for name in williams_order(names, index):
                    _reload(port, config_path, config(states[name])(port))
                    for c in (1, 16):
                        # a reload that turns tracing on starts an exporter (thread, connection):
                        # warmed up past that, the rounds measure tracing, not the switch
                        warm, _, _ = asyncio.run(_load(port, request, c, args.warmup))
                        cpu0 = cpu_seconds(proc.pid)
                        latencies, errors, elapsed = asyncio.run(_load(port, request, c, args.seconds))
                        cpu_ms = (cpu_seconds(proc.pid) - cpu0) * 1000 / max(len(latencies), 1)
                        if name in served:
                            served[name] += len(warm) + len(latencies)
                        result.setdefault(name, {})[f"c{c}"] = summarize(latencies, elapsed) | {
                            "errors": len(errors),
                            "gateway_cpu_ms_per_request": cpu_ms,
                        }
                rounds.append(result)
                print(json.dumps({k: {c: round(v["rps"]) for c, v in r.items()} for k, r in result.items()}))
        finally:
            proc.terminate()
            proc.wait(timeout=30)  # a traced gateway sends its last spans as it stops
    exported = httpx.get(f"http://127.0.0.1:{collector_port}/", timeout=120).json()
    collector.kill()
    summary = summarize_rounds(rounds, names)
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": vars(args),
        "collector": exported
        | {
            "requests_traced_gateways_served": served,
            "requests_traced_paired": paired["traced_requests"] if paired else 0,
        },
        "median": summary,
        "rounds": rounds,
        "paired": paired,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tracing.json").write_text(json.dumps(out, indent=2))
    from bench.plots import plot_tracing  # the PNG beside the JSON (bench/plots.py)

    plot_tracing(out, RESULTS / "tracing.png")
    print(json.dumps(summary | {"collector": out["collector"]}, indent=1))
    if paired is not None:
        print(json.dumps({"paired": paired["median"]}, indent=1))


if __name__ == "__main__":
    main()
