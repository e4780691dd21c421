"""The floor under issue 16's targets: what grpc.aio and the HTTP stack cost with no gateway behind them.

bench_grpc.py measures the gateway CPU per request of fleetgate's gRPC front door against its HTTP
one (its figures: bench/results/grpc.json). This asks how much of a gap between them the protocol
stacks themselves take. Four servers, each its
own process, driven in interleaved rounds by the clients of bench_grpc.py (one request serialized
once, closed loop, c=1 and c=16, the digits model's one-row request):
  - bare_grpc: a `grpc.aio` server on uvloop (the loop fleetgate's gRPC server shares) with one
    generic unary handler for `ModelInfer` that takes the request's bytes and returns a response
    serialized in advance: no protobuf parsing, no model, nothing of fleetgate;
  - bare_grpc_threads: the same handler on grpcio's other server, `grpc.server` with a thread pool;
  - bare_http: uvicorn with httptools and uvloop (fleetgate's HTTP stack) and a plain ASGI app that
    reads the body and returns a fixed binary v2 response: again nothing of fleetgate;
  - fleetgate_grpc and fleetgate_http: `fleetgate serve` with the digits model on ONNX Runtime,
    as in bench_grpc.py.
Reported per server: requests/s, p50, server CPU per request (user + system from /proc), medians of
rounds, and ONNX Runtime called directly for the c=1 floor. If bare gRPC alone costs more CPU per
request than fleetgate's whole HTTP path, no gRPC servicer on grpc.aio can meet "gRPC costs no more
gateway CPU than HTTP".

Writes bench/results/grpc_floor.json and .png. Run: `.venv/bin/python -m bench.bench_grpc_floor`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.bench_gateway import run_direct, start_gateway
from bench.bench_grpc import digits_config, free_port, run_grpc, run_http

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
CONCURRENCY = (1, 16)
SERVERS = ("bare_grpc", "bare_grpc_threads", "bare_http", "fleetgate_grpc", "fleetgate_http")


def _infer_response() -> tuple[bytes, bytes, bytes]:
    """The gRPC response bytes, and the HTTP v2 binary response's JSON header and tensor bytes, of a
    10-class FP32 output (what the digits model answers for one row)."""
    from tritonclient.grpc import service_pb2

    scores = np.linspace(0, 1, 10, dtype=np.float32).reshape(1, 10)
    response = service_pb2.ModelInferResponse(model_name="digits", model_version="1", id="0")
    response.outputs.add(name="output", datatype="FP32", shape=[1, 10])
    response.raw_output_contents.append(scores.tobytes())
    header = json.dumps(
        {
            "model_name": "digits",
            "model_version": "1",
            "outputs": [
                {
                    "name": "output",
                    "datatype": "FP32",
                    "shape": [1, 10],
                    "parameters": {"binary_data_size": scores.nbytes},
                },
            ],
        }  # fmt: skip
    ).encode()
    return response.SerializeToString(), header, scores.tobytes()


def serve_bare_grpc(port: int) -> None:
    import grpc
    import uvloop

    answer = _infer_response()[0]

    async def model_infer(request: bytes, context: object) -> bytes:
        return answer

    async def main() -> None:
        handler = grpc.method_handlers_generic_handler(
            "inference.GRPCInferenceService",
            {"ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer)},  # bytes in, bytes out
        )
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    uvloop.run(main())


def serve_bare_grpc_threads(port: int) -> None:
    """The same handler on grpcio's thread-pool server (`grpc.server`), the other server grpcio has."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    answer = _infer_response()[0]

    def model_infer(request: bytes, context: object) -> bytes:
        return answer

    handler = grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer)}
    )
    server = grpc.server(ThreadPoolExecutor(max_workers=16))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


def serve_bare_http(port: int) -> None:
    import uvicorn

    _, header, tensor = _infer_response()
    body = header + tensor
    headers = [
        (b"content-type", b"application/octet-stream"),
        (b"inference-header-content-length", str(len(header)).encode()),
        (b"content-length", str(len(body)).encode()),
    ]

    async def app(scope: dict, receive, send) -> None:  # noqa: ANN001 - plain ASGI
        if scope["type"] != "http":
            return
        more = True
        while more:  # read the whole request body, as any handler must
            message = await receive()
            more = message.get("more_body", False)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    print("ready", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=port, http="httptools", loop="uvloop", log_level="warning",
                access_log=False, lifespan="off")  # fmt: skip


#: `--serve` value -> the bare server it runs (in its own process)
BARE_SERVERS = {"grpc": serve_bare_grpc, "grpc_threads": serve_bare_grpc_threads, "http": serve_bare_http}


def _start_bare(kind: str, port: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_grpc_floor", "--serve", kind, "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # uvicorn prints before it binds
    return proc


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench import plotting  # bench/plotting.py: the footer with the date and machine

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = np.arange(len(SERVERS))
    for i, c in enumerate(CONCURRENCY):
        cpu = [summary[f"c{c}"][s]["gateway_cpu_ms_per_request"] for s in SERVERS]
        axes[0].bar(xs + (i - 0.5) * 0.35, cpu, 0.35, label=f"c={c}")
        p50 = [summary[f"c{c}"][s]["p50_ms"] for s in SERVERS]
        axes[1].bar(xs + (i - 0.5) * 0.35, p50, 0.35, label=f"c={c}")
    for ax, label in zip(axes, ("server CPU per request (ms)", "p50 latency (ms)"), strict=True):
        ax.set_xticks(xs, [s.replace("_", "\n") for s in SERVERS])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("protocol stacks alone vs fleetgate, one-row digits requests (medians of rounds)")
    fig.tight_layout()
    plotting.save(fig, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", choices=tuple(BARE_SERVERS), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.serve:
        return BARE_SERVERS[args.serve](args.port)
    from backends.demo_models.digits import digits_split, write_digits

    x = np.ascontiguousarray(digits_split()[1][:1].astype(np.float32))
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        digits = write_digits(Path(tmp))
        grpc_port = free_port()

        gateway, http_port, key = start_gateway(Path(tmp), digits_config(digits.onnx_path, grpc_port))
        bare_grpc_port, bare_http_port = free_port(), free_port()
        bare_grpc = _start_bare("grpc", bare_grpc_port)
        bare_http = _start_bare("http", bare_http_port)
        threads_port = free_port()
        bare_threads = _start_bare("grpc_threads", threads_port)

        def measure(name: str, c: int) -> dict[str, float]:
            if name == "bare_grpc":
                return run_grpc(f"127.0.0.1:{bare_grpc_port}", key, x, c, args.seconds, bare_grpc.pid)
            if name == "bare_grpc_threads":
                return run_grpc(f"127.0.0.1:{threads_port}", key, x, c, args.seconds, bare_threads.pid)
            if name == "bare_http":
                return run_http(bare_http_port, key, x, c, args.seconds, bare_http.pid)
            if name == "fleetgate_grpc":
                return run_grpc(f"127.0.0.1:{grpc_port}", key, x, c, args.seconds, gateway.pid)
            return run_http(http_port, key, x, c, args.seconds, gateway.pid)

        try:
            for r in range(args.rounds):
                result: dict = {}
                for c in CONCURRENCY:
                    order = SERVERS[r % len(SERVERS) :] + SERVERS[: r % len(SERVERS)]  # rotated per round
                    cell = {name: measure(name, c) for name in order}
                    cell["direct"] = run_direct(digits.onnx_path, c, args.seconds, x.shape[1], x)
                    result[f"c{c}"] = cell
                    print(json.dumps({"round": r, "c": c, **{
                        k: [round(v["p50_ms"], 3), round(v.get("gateway_cpu_ms_per_request", 0), 3)]
                        for k, v in cell.items()}}))  # fmt: skip
                rounds.append(result)
        finally:
            for proc in (gateway, bare_grpc, bare_threads, bare_http):
                proc.terminate()
                proc.wait(timeout=30)

    summary: dict = {}
    for c in CONCURRENCY:
        cell = {
            name: {
                k: float(statistics.median(r[f"c{c}"][name][k] for r in rounds))
                for k in rounds[0][f"c{c}"][name]
            }
            for name in (*SERVERS, "direct")
        }
        cpu = {s: cell[s]["gateway_cpu_ms_per_request"] for s in SERVERS}
        cell["derived"] = {
            "bare_grpc_over_bare_http_cpu": cpu["bare_grpc"] / cpu["bare_http"],
            "bare_grpc_threads_over_bare_http_cpu": cpu["bare_grpc_threads"] / cpu["bare_http"],
            "bare_grpc_over_fleetgate_http_cpu": cpu["bare_grpc"] / cpu["fleetgate_http"],
            "fleetgate_grpc_over_fleetgate_http_cpu": cpu["fleetgate_grpc"] / cpu["fleetgate_http"],
            "fleetgate_grpc_minus_bare_grpc_cpu_ms": cpu["fleetgate_grpc"] - cpu["bare_grpc"],
            "fleetgate_http_minus_bare_http_cpu_ms": cpu["fleetgate_http"] - cpu["bare_http"],
            "bare_grpc_added_p50_ms": cell["bare_grpc"]["p50_ms"] - cell["direct"]["p50_ms"],
            "bare_http_added_p50_ms": cell["bare_http"]["p50_ms"] - cell["direct"]["p50_ms"],
            "fleetgate_grpc_added_p50_ms": cell["fleetgate_grpc"]["p50_ms"] - cell["direct"]["p50_ms"],
            "fleetgate_http_added_p50_ms": cell["fleetgate_http"]["p50_ms"] - cell["direct"]["p50_ms"],
        }
        summary[f"c{c}"] = cell
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": {"seconds": args.seconds, "rounds": args.rounds, "concurrency": CONCURRENCY},
        "summary_median_of_rounds": summary,
        "rounds": rounds,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grpc_floor.json").write_text(json.dumps(out, indent=2))
    plot(summary, RESULTS / "grpc_floor.png")
    print(json.dumps({c: v["derived"] for c, v in summary.items()}, indent=1))


if __name__ == "__main__":
    main()
