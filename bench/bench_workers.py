"""`server.workers`: one gateway process against two on the same port, side by side in one run.

Two `fleetgate serve` processes are started from the same config except `server.workers` (1 and 2),
with SQLite state (shared by the workers), a tenant without limits, and two ONNX Runtime models from
bench_gateway.py: `light` (256 -> 1024 -> 10, per-request overhead dominates) and `heavy` (512 -> 4096
-> 4096 -> 10), each with `intra_op_threads: 1` and batching. wrk (one thread, 32 connections) posts
one-row JSON v2 bodies for `--seconds`; the two gateways alternate within each round, and the ratio
workers=2 / workers=1 is taken within a round. The load generator shares the machine's cores with the
gateway: on 2 cores, a second worker competes with wrk for the second core.

Beside them, the floor of the server stack: bench/floor_servers.py's bare batching tensor server
(uvicorn, httptools, uvloop, a plain ASGI app: msgspec decode, ONNX Runtime with one intra-op thread,
requests gathered while a run is in flight) started with 1 and 2 uvicorn workers and driven the same
way. Its 2-over-1 ratio is what a second process buys on this machine with no gateway at all: a
target above it is beyond the machine and the stack (`--no-floor` leaves it out).

`--thread-defaults`: instead, two gateways with `server.workers: 2` and no thread count in the
models' options, side by side: `share` as the code runs them (each worker's ONNX Runtime takes its
share of the cores, `backends/cores.py`) against `every_core` (`intra_op_threads` set to every core
the machine has, what each worker's ONNX Runtime started before that default: N workers x the cores
in threads). Writes bench/results/workers_threads.json.

Writes bench/results/workers.json. Run: `.venv/bin/python -m bench.bench_workers [--seconds 5 --rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tempfile
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from bench import floor_servers
from bench.bench_gateway import build_model, start_gateway
from bench.servers import stop

MODELS = {"light": (256, 1024), "heavy": (512, 4096)}
RESULTS = Path(__file__).resolve().parent / "results"


def config(port: int, workers: int, tmp: Path, options: str = "options: {intra_op_threads: 1}, ") -> str:
    """`options` is the models' options entry (with its trailing comma and space), empty for none."""
    lines = [
        f"server: {{port: {port}, log_level: warning, workers: {workers}}}",
        f'state: {{url: "sqlite:///{tmp}/state-{port}.db"}}',
        "tenants: {bench: {}}",
        "deployments:",
    ]
    for name in MODELS:
        lines.append(
            f"  {name}: {{backend: onnxruntime, model: {tmp / name}.onnx, {options}"
            "batching: {max_batch_size: 64, max_delay_ms: 2}, queue: {max_concurrency: 64}}"
        )
    lines.append("models:")
    lines += [f"  {n}: {{routes: [{{deployment: {n}}}]}}" for n in MODELS]
    return "\n".join(lines) + "\n"


def wrk(port: int, key: str, model: str, d_in: int, seconds: float, tmp: Path) -> dict[str, float]:
    row = np.random.default_rng(1).standard_normal(d_in).round(4).tolist()
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, d_in], "datatype": "FP32", "data": row}]})
    script = tmp / f"{model}.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(body)}\n"
        f'wrk.headers["Authorization"] = "Bearer {key}"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
    )
    url = f"http://127.0.0.1:{port}/v2/models/{model}/infer"
    subprocess.run(["wrk", "-t1", "-c32", "-d1s", "-s", str(script), url], capture_output=True)  # warm-up
    out = subprocess.run(
        ["wrk", "-t1", "-c32", f"-d{max(1, round(seconds))}s", "--latency", "-s", str(script), url],
        capture_output=True,
        text=True,
    )
    found = re.search(r"Requests/sec:\s+([\d.]+)", out.stdout)
    if found is None:
        raise RuntimeError(f"wrk failed: {out.stdout[-500:]} {out.stderr[-500:]}")
    rps = float(found.group(1))
    out = out.stdout
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    p50 = re.search(r"50%\s+([\d.]+)(us|ms|s)", out)
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}
    p50_ms = float(p50.group(1)) * scale[p50.group(2)] if p50 else float("nan")
    return {"rps": rps, "p50_ms": p50_ms, "non_2xx": int(non2xx.group(1)) if non2xx else 0}


def start_floor(tmp: Path, workers: int, stack: ExitStack) -> tuple[int, str]:
    """bench/floor_servers.py's bare batching server for both models with `workers` processes."""
    models = [f"--model={m}={tmp / m}.onnx" for m in MODELS]
    args = ["tensors", *models, "--threads=1", f"--workers={workers}"]
    port, _ = floor_servers.start(args, tmp / f"floor-{workers}.log", stack)
    return port, "none"


def build_models(tmp: Path) -> None:
    for model, (d_in, hidden) in MODELS.items():
        build_model(tmp / f"{model}.onnx", d_in, hidden)


def measure_pair(
    servers: dict, first: object, second: object, model: str, r: int, seconds: float, tmp: Path
) -> dict:
    """wrk on `servers[first]` and `servers[second]` back to back (the order alternating by round `r`);
    their results by key, and `ratio`: second's requests/s over first's."""
    d_in = MODELS[model][0]
    order = (first, second) if r % 2 == 0 else (second, first)
    runs = {key: wrk(*servers[key], model, d_in, seconds, tmp) for key in order}
    return {**runs, "ratio": runs[second]["rps"] / runs[first]["rps"]}


def compare_thread_defaults(seconds: float, rounds: int) -> None:
    """Two workers with the runtimes' default threads (a worker's share) against every core each."""
    from backends.cores import available_cores

    variants = {"share": "", "every_core": f"options: {{intra_op_threads: {available_cores()}}}, "}
    measured = []
    with tempfile.TemporaryDirectory() as name, ExitStack() as stack:
        tmp = Path(name)
        build_models(tmp)
        servers = {}
        for variant, options in variants.items():
            proc, port, key = start_gateway(tmp, lambda p, o=options: config(p, 2, tmp, o))
            stack.callback(stop, proc, False)
            servers[variant] = (port, key)
        for r in range(rounds):
            point = {
                model: measure_pair(servers, "every_core", "share", model, r, seconds, tmp)
                for model in MODELS
            }
            print(json.dumps(point), flush=True)
            measured.append(point)
    median = {
        model: {
            **{f"{v}_rps": statistics.median(p[model][v]["rps"] for p in measured) for v in variants},
            **{f"{v}_p50_ms": statistics.median(p[model][v]["p50_ms"] for p in measured) for v in variants},
            "share_over_every_core": statistics.median(p[model]["ratio"] for p in measured),
            "per_round": [round(p[model]["ratio"], 3) for p in measured],
        }
        for model in MODELS
    }
    report = {
        "seconds": seconds,
        "workers": 2,
        "cores": available_cores(),
        "rounds": measured,
        "median": median,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "workers_threads.json").write_text(json.dumps(report, indent=1))
    from bench.plots import plot_workers_threads  # the PNG beside the JSON (bench/plots.py)

    plot_workers_threads(report, RESULTS / "workers_threads.png")
    print(json.dumps(median, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-floor", action="store_true", help="leave out the bare-stack floor servers")
    parser.add_argument(
        "--thread-defaults",
        action="store_true",
        help="two workers: a worker's share of the cores vs every core",
    )
    args = parser.parse_args()
    if args.thread_defaults:
        compare_thread_defaults(args.seconds, args.rounds)
        return
    kinds = ["gateway"] if args.no_floor else ["gateway", "floor"]
    with tempfile.TemporaryDirectory() as name, ExitStack() as stack:
        tmp = Path(name)
        build_models(tmp)
        servers: dict[tuple[str, int], tuple[int, str]] = {}
        for w in (1, 2):
            proc, port, key = start_gateway(tmp, lambda p, w=w: config(p, w, tmp))
            stack.callback(stop, proc, False)
            servers["gateway", w] = (port, key)
            if not args.no_floor:
                servers["floor", w] = start_floor(tmp, w, stack)
        rounds = []
        for r in range(args.rounds):
            point: dict[str, dict] = {}
            for kind in kinds:
                for model in MODELS:
                    runs = measure_pair(servers, (kind, 1), (kind, 2), model, r, args.seconds, tmp)
                    point[model if kind == "gateway" else f"floor_{model}"] = {
                        "workers_1": runs[kind, 1],
                        "workers_2": runs[kind, 2],
                        "ratio": runs["ratio"],
                    }
            print(json.dumps(point), flush=True)
            rounds.append(point)
    median = {
        entry: {
            **{
                f"workers_{w}_rps": statistics.median(p[entry][f"workers_{w}"]["rps"] for p in rounds)
                for w in (1, 2)
            },
            "ratio_2_over_1": statistics.median(p[entry]["ratio"] for p in rounds),
        }
        for entry in rounds[0]
    }
    RESULTS.mkdir(exist_ok=True)
    from backends.cores import available_cores

    report = {"seconds": args.seconds, "rounds": rounds, "median": median, "cores": available_cores()}
    (RESULTS / "workers.json").write_text(json.dumps(report, indent=1))
    from bench.plots import plot_workers  # the PNG beside the JSON (bench/plots.py)

    plot_workers(report, RESULTS / "workers.png")
    print(json.dumps(median, indent=1))


if __name__ == "__main__":
    main()
