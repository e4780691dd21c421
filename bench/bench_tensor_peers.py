"""Tensor serving next to its peers: fleetgate, KServe and BentoML on one ONNX model, in one run.

Model: bench_gateway's "heavy" MLP 512 -> 4096 -> 4096 -> 10 fp32 (18.9 M multiply-adds = ~38 MFLOP per
row; 75 MB of weights), input `input`, one row per request. Each server is its own subprocess on a
free loopback port, on ONNX Runtime's CPU provider without spinning threads (fleetgate's adapter
default), per-request logging off:
  - fleetgate: one `onnxruntime` deployment, `batching: {max_batch_size: 64, max_delay_ms: 2}`,
    `queue: {max_concurrency: 64}`, a tenant without limits, state `memory://`, the tenant's key;
  - KServe: a `kserve.Model` whose synchronous `predict` runs the session on the v2 request (no
    batching, as KServe's custom-model docs write it), `kserve.ModelServer(workers=1)`, gRPC off;
  - BentoML: an adaptive-batching API (`batchable=True, max_batch_size=64`), `bentoml serve`, 1 worker;
    its `max_latency_ms` is a latency budget (requests predicted to miss it get a 503), not a wait
    window, so it is generous (1000 ms). Body: BentoML's own JSON `{"input": [[...]]}`;
  - ONNX Runtime alone, in this process, one thread: 1-row calls (the latency floor) and 64-row calls
    (rows/s: the ceiling for a batching server on this CPU);
  - the floor of fleetgate's own server stack (bench/floor_servers.py: uvicorn, httptools and uvloop
    with a plain ASGI app and nothing of a gateway): `floor_batching` gathers the requests that
    arrive during a run into the next one (up to 64 rows) on a worker thread, `floor_inline` runs
    every call on the event loop's thread. They answer what any gateway on this stack can reach
    here: if `floor_batching` is under 4x the best peer at c=32, or `floor_inline`'s c=1 p50 is over
    0.3 ms above ONNX Runtime's, that target is beyond the stack itself (`--no-floor` leaves them out).
Peers install on first run into bench/.venvs/{kserve,bentoml} (with the project's ONNX Runtime version);
their server code is written into a temp dir. A peer that cannot be installed, started or answer
correctly is listed under `skipped` with the reason, and the others run.

Method: JSON bodies (v2 for fleetgate and KServe) encoded before the clock starts; bench_gateway's
closed-loop keep-alive raw-socket client at c=1 and c=32, a short warm-up, then `--seconds` per point.
Each answer is checked once first (200, 10 outputs equal to ONNX Runtime's). The 2-core machine is
shared and noisy: a round runs every point back to back (server order rotating between rounds), ratios
are taken within a round and medians over rounds reported: fleetgate / best peer (req/s, p50) per
concurrency, fleetgate c=32 req/s over ORT 64-row rows/s, fleetgate c=1 p50 minus ORT 1-row p50.
A round runs c=1 before c=32, so c=1 in round 1 meets servers that never saw load and in later rounds
servers that just served c=32; both are reported (`c1_p50_ms_round1_vs_later_rounds`) because BentoML's
batcher learns its wait from past batches (mean wait of the last 50) and keeps waiting for company
at c=1 for tens of seconds after a burst.

Writes bench/results/tensor_peers.json and .png.
Run: `.venv/bin/python -m bench.bench_tensor_peers [--seconds 4 --rounds 3]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort

from bench import floor_servers
from bench.bench_gateway import _load, build_model, pct, start_gateway, summarize
from bench.peer_venvs import VENVS, ensure_peer_venv
from bench.servers import free_port, stop, wait_ready

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
D_IN, HIDDEN, D_OUT = 512, 4096, 10
CONCURRENCY = (1, 32)
PEERS = ("kserve", "bentoml")
FLOORS = {"floor_batching": (), "floor_inline": ("--inline",)}
BENTO_MAX_LATENCY_MS = 1000

KSERVE_SERVER = """\
import logging, sys
import numpy as np, onnxruntime as ort, uvicorn, kserve
from kserve import InferOutput, InferRequest, InferResponse
from kserve.utils.utils import generate_uuid

_config_init = uvicorn.Config.__init__
def _loopback(self, *args, **kwargs):  # ModelServer hard-codes host 0.0.0.0
    kwargs["host"] = "127.0.0.1"
    _config_init(self, *args, **kwargs)
uvicorn.Config.__init__ = _loopback

class OnnxMlp(kserve.Model):
    def __init__(self, name: str, path: str) -> None:
        super().__init__(name)
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])
        self.ready = True

    def predict(self, payload: InferRequest, headers=None) -> InferResponse:
        y = self.session.run(None, {"input": payload.inputs[0].as_numpy()})[0]
        out = InferOutput(name="output", shape=list(y.shape), datatype="FP32", data=y)
        return InferResponse(model_name=self.name, infer_outputs=[out], response_id=payload.id or generate_uuid())

if __name__ == "__main__":
    server = kserve.ModelServer(http_port=int(sys.argv[1]), workers=1, enable_grpc=False,
                                enable_latency_logging=False)
    for name in ("uvicorn.access", "kserve.trace", "kserve"):
        logging.getLogger(name).setLevel(logging.WARNING)
    server.start([OnnxMlp("mlp", sys.argv[2])])
"""

BENTO_SERVICE = """\
import numpy as np, onnxruntime as ort, bentoml

@bentoml.service(workers=1, logging={{"access": {{"enabled": False}}}})
class Mlp:
    def __init__(self) -> None:
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession({model!r}, sess_options=opts, providers=["CPUExecutionProvider"])

    @bentoml.api(batchable=True, max_batch_size=64, max_latency_ms={latency})
    def predict(self, input: np.ndarray) -> np.ndarray:
        return self.session.run(None, {{"input": input.astype(np.float32, copy=False)}})[0]
"""


# --- peers: install and start --------------------------------------------------------------------


def start_peer(name: str, tmp: Path, model: Path, stack: ExitStack) -> int:
    """Installs (first run) and starts one peer server; returns its port."""
    # the project's ORT version where a plain wheel of it exists, so the runtime is the same
    venv = ensure_peer_venv(
        name, ([name, "numpy", f"onnxruntime=={ort.__version__}"], [name, "numpy", "onnxruntime"])
    )
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    if name == "kserve":
        (tmp / "kserve_server.py").write_text(KSERVE_SERVER)
        cmd = [str(venv / "bin" / "python"), "kserve_server.py", str(port), str(model)]
        ready = f"http://127.0.0.1:{port}/v2/models/mlp/ready"
    else:
        (tmp / "service.py").write_text(BENTO_SERVICE.format(model=str(model), latency=BENTO_MAX_LATENCY_MS))
        cmd = [str(venv / "bin" / "bentoml"), "serve", "service:Mlp", "--host", "127.0.0.1"]
        cmd += ["--port", str(port)]
        env |= {"BENTOML_HOME": str(tmp / "bentoml-home"), "BENTOML_DO_NOT_TRACK": "true"}
        ready = f"http://127.0.0.1:{port}/readyz"
    log = tmp / f"{name}.log"
    proc = subprocess.Popen(
        cmd, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb"), start_new_session=True
    )
    stack.callback(stop, proc)
    try:
        wait_ready(proc, ready, log)
    except RuntimeError:
        stop(proc)
        raise
    return port


# --- requests ------------------------------------------------------------------------------------


#: server -> (path, body, headers) of the one request it is sent
Spec = tuple[str, bytes, dict[str, str]]


def request_specs(key: str, row: np.ndarray) -> dict[str, Spec]:
    tensor = {"name": "input", "shape": [1, D_IN], "datatype": "FP32", "data": row.ravel().tolist()}
    v2 = json.dumps({"inputs": [tensor]}).encode()
    json_type = {"Content-Type": "application/json"}  # KServe reads a body without it as binary tensors
    return {
        "fleetgate": ("/v2/models/mlp/infer", v2, {**json_type, "Authorization": f"Bearer {key}"}),
        "kserve": ("/v2/models/mlp/infer", v2, json_type),
        **{name: ("/v2/models/mlp/infer", v2, json_type) for name in FLOORS},
        "bentoml": ("/predict", json.dumps({"input": row.tolist()}).encode(), json_type),
    }


def raw_request(port: int, spec: Spec) -> bytes:
    """The keep-alive HTTP/1.1 JSON POST that bench_gateway's `_load` sends over and over."""
    path, body, headers = spec
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}Content-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def verify(name: str, port: int, spec: Spec, expected: np.ndarray) -> dict[str, Any]:
    """Sends the request once; raises unless the answer is a 200 with ONNX Runtime's 10 outputs."""
    path, body, headers = spec
    r = httpx.post(f"http://127.0.0.1:{port}{path}", content=body, headers=headers, timeout=30)
    if r.status_code != 200:
        raise RuntimeError(f"{name}: status {r.status_code}: {r.text[:300]}")
    payload = r.json()  # v2: {"outputs": [{"data": [...]}]}; BentoML: [[...]]
    got = np.asarray(payload["outputs"][0]["data"] if isinstance(payload, dict) else payload, np.float32)
    if got.size != D_OUT:
        raise RuntimeError(f"{name}: {got.size} outputs, expected {D_OUT}")
    diff = float(np.abs(got.ravel() - expected.ravel()).max())
    if diff > 1e-3:
        raise RuntimeError(f"{name}: outputs differ from ONNX Runtime's by {diff}")
    return {"status": 200, "outputs": int(got.size), "max_abs_diff_vs_ort": diff}


def run_point(port: int, request: bytes, concurrency: int, seconds: float) -> dict[str, float]:
    asyncio.run(_load(port, request, concurrency, min(1.0, seconds / 4)))  # warm-up
    latencies, errors, elapsed = asyncio.run(_load(port, request, concurrency, seconds))
    return {**summarize(latencies, elapsed), "errors": len(errors)}


# --- ONNX Runtime alone --------------------------------------------------------------------------


def run_ort(session: ort.InferenceSession, row: np.ndarray, seconds: float) -> dict[str, float]:
    """Single-row call latency (one thread) and 64-row call throughput (one thread), `seconds` each."""
    batch = np.ascontiguousarray(np.repeat(row, 64, axis=0))

    def timed(x: np.ndarray) -> tuple[list[float], float]:
        for _ in range(3):
            session.run(None, {"input": x})
        out: list[float] = []
        start = time.perf_counter()
        while (t0 := time.perf_counter()) < start + seconds:
            session.run(None, {"input": x})
            out.append(time.perf_counter() - t0)
        return out, time.perf_counter() - start

    single, _ = timed(row)
    calls, elapsed = timed(batch)
    return {
        "row_p50_ms": pct(single, 50) * 1000,
        "row_p99_ms": pct(single, 99) * 1000,
        "row_calls_per_s": len(single) / seconds,
        "batch64_rows_per_s": 64 * len(calls) / elapsed,
        "batch64_p50_ms": pct(calls, 50) * 1000,
    }


# --- rounds and report ---------------------------------------------------------------------------


def one_round(
    r: int,
    targets: dict[str, tuple[int, bytes]],
    session: ort.InferenceSession,
    row: np.ndarray,
    seconds: float,
) -> dict[str, Any]:
    """ONNX Runtime alone, then every server at each concurrency; the server order rotates per round."""
    names = list(targets)
    order = names[r % len(names) :] + names[: r % len(names)]  # rotate so no server always goes first
    result: dict[str, Any] = {"order": order, "ort": run_ort(session, row, seconds)}
    for c in CONCURRENCY:
        for name in order:
            p = run_point(*targets[name], c, seconds)
            result.setdefault(name, {})[f"c{c}"] = p
            sys.stderr.write(
                f"round {r + 1} {name:9s} c={c:<2d} {p['rps']:7.1f} req/s p50 {p['p50_ms']:7.2f} ms "
                f"p99 {p['p99_ms']:7.2f} ms errors {p['errors']}\n"
            )
    return result


def ratio_series(rounds: list[dict[str, Any]], f: Callable[[dict[str, Any]], float]) -> dict[str, Any]:
    values = [round(f(r), 3) for r in rounds]
    return {"median": round(statistics.median(values), 3), "per_round": values}


def derive(rounds: list[dict[str, Any]], servers: list[str]) -> dict[str, Any]:
    peers = [s for s in servers if s in PEERS]
    out: dict[str, Any] = {
        "gateway_added_p50_ms_c1": ratio_series(
            rounds, lambda r: r["fleetgate"]["c1"]["p50_ms"] - r["ort"]["row_p50_ms"]
        ),
        "fleetgate_c32_rps_over_ort_batch64_rows_per_s": ratio_series(
            rounds, lambda r: r["fleetgate"]["c32"]["rps"] / r["ort"]["batch64_rows_per_s"]
        ),
    }
    if len(rounds) > 1:  # c=1 in round 1 precedes any c=32 load; in later rounds it follows one
        out["c1_p50_ms_round1_vs_later_rounds"] = {
            s: [
                round(rounds[0][s]["c1"]["p50_ms"], 3),
                round(statistics.median(r[s]["c1"]["p50_ms"] for r in rounds[1:]), 3),
            ]
            for s in servers
        }
    if "floor_inline" in servers:  # what the bare server stack adds to one call at c=1
        out["floor_inline_added_p50_ms_c1"] = ratio_series(
            rounds, lambda r: r["floor_inline"]["c1"]["p50_ms"] - r["ort"]["row_p50_ms"]
        )
    if "floor_batching" in servers:
        out["fleetgate_over_floor_batching_rps_c32"] = ratio_series(
            rounds, lambda r: r["fleetgate"]["c32"]["rps"] / r["floor_batching"]["c32"]["rps"]
        )
        if peers:
            out["floor_batching_over_best_peer_rps_c32"] = ratio_series(
                rounds, lambda r: r["floor_batching"]["c32"]["rps"] / max(r[p]["c32"]["rps"] for p in peers)
            )
    if not peers:
        return out
    for c in CONCURRENCY:
        k = f"c{c}"
        out[f"fleetgate_over_best_peer_rps_{k}"] = ratio_series(
            rounds, lambda r, k=k: r["fleetgate"][k]["rps"] / max(r[p][k]["rps"] for p in peers)
        )
        out[f"fleetgate_over_best_peer_p50_{k}"] = ratio_series(
            rounds, lambda r, k=k: r["fleetgate"][k]["p50_ms"] / min(r[p][k]["p50_ms"] for p in peers)
        )
        out[f"best_peer_rps_{k}"] = [max(peers, key=lambda p, r=r, k=k: r[p][k]["rps"]) for r in rounds]
    return out


def medians(rounds: list[dict[str, Any]], servers: list[str]) -> dict[str, Any]:
    def med(server: str, key: str, metric: str | None = None) -> float:
        values = [r[server][key] if metric is None else r[server][key][metric] for r in rounds]
        return round(statistics.median(values), 3)

    metrics = ("rps", "p50_ms", "p99_ms", "errors")
    table: dict[str, Any] = {
        s: {f"c{c}": {m: med(s, f"c{c}", m) for m in metrics} for c in CONCURRENCY} for s in servers
    }
    return table | {"ort": {k: med("ort", k) for k in rounds[0]["ort"]}}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med, servers = report["median"], report["servers"]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    xs = np.arange(len(servers))
    for i, c in enumerate(CONCURRENCY):
        axes[0].bar(xs + (i - 0.5) * 0.4, [med[s][f"c{c}"]["rps"] for s in servers], 0.4, label=f"c={c}")
        for ax, metric in ((axes[1], "p50_ms"), (axes[2], "p99_ms")):
            ax.bar(xs + (i - 0.5) * 0.4, [med[s][f"c{c}"][metric] for s in servers], 0.4, label=f"c={c}")
    line = {"color": "black", "linestyle": "--", "linewidth": 0.8}
    axes[0].axhline(med["ort"]["batch64_rows_per_s"], label="ORT alone, 64-row calls (rows/s)", **line)
    axes[1].axhline(med["ort"]["row_p50_ms"], label="ORT alone, 1-row call p50", **line)
    titles = ("requests/s (1 row each)", "p50 latency (ms)", "p99 latency (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xticks(xs, servers)
        ax.set_title(f"{title}, median of {report['rounds']} rounds")
        ax.legend(fontsize=8)
        if ax is not axes[0]:
            ax.set_yscale("log")
    fig.suptitle(
        f"MLP {D_IN}-{HIDDEN}-{HIDDEN}-{D_OUT} fp32, JSON bodies, closed loop, {os.cpu_count()} CPUs"
    )
    fig.tight_layout()
    from bench import plotting  # bench/plotting.py: the footer with the date and machine

    plotting.save(fig, path)


def versions(servers: list[str]) -> dict[str, str]:
    out = {"python": platform.python_version(), "onnxruntime_fleetgate": ort.__version__}
    for name in (s for s in servers if s in PEERS):
        code = f"import importlib.metadata as m; print(m.version({name!r}), m.version('onnxruntime'))"
        got = subprocess.run([VENVS / name / "bin" / "python", "-c", code], capture_output=True, text=True)
        out[name], out[f"onnxruntime_{name}"] = got.stdout.split()
    return out


GATEWAY_CONFIG = """\
server: {{port: {port}, log_level: warning}}
state: {{url: "memory://"}}
tenants: {{bench: {{}}}}
deployments:
  mlp: {{backend: onnxruntime, model: {model}, batching: {{max_batch_size: 64, max_delay_ms: 2}},
         queue: {{max_concurrency: 64}}{options}}}
models:
  mlp: {{routes: [{{deployment: mlp}}]}}
"""


def start_servers(
    tmp: Path, model: Path, row: np.ndarray, expected: np.ndarray, stack: ExitStack, floors: bool = True
) -> tuple[dict[str, bytes], dict[str, Any], dict[str, str]]:
    """Starts and checks every server; returns port -> raw request, the checks and the peers skipped."""
    gateway, port, key = start_gateway(tmp, lambda p: GATEWAY_CONFIG.format(port=p, model=model, options=""))
    stack.callback(stop, gateway, False)
    ports, skipped = {"fleetgate": port}, {}
    for name in FLOORS if floors else ():
        ports[name], _ = floor_servers.start(
            ["tensors", "--model", str(model), *FLOORS[name]], tmp / f"{name}.log", stack
        )
    for name in PEERS:
        try:
            ports[name] = start_peer(name, tmp, model, stack)
        except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
            skipped[name] = f"could not install or start: {type(e).__name__}: {e}"
    specs = request_specs(key, row)
    checks = {}
    for name in list(ports):
        try:
            checks[name] = verify(name, ports[name], specs[name], expected)
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as e:
            if name == "fleetgate":
                raise
            skipped[name] = f"wrong answer: {type(e).__name__}: {e}"
            del ports[name]
    for name, why in skipped.items():
        sys.stderr.write(f"skipping {name}: {why}\n")
    return {name: (p, raw_request(p, specs[name])) for name, p in ports.items()}, checks, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per point")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (medians are reported)")
    parser.add_argument("--out", type=Path, default=RESULTS / "tensor_peers.json")
    parser.add_argument("--no-floor", action="store_true", help="leave out the bare-stack floor servers")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below on SIGTERM too
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp, ExitStack() as stack:
        model = Path(tmp) / "mlp.onnx"
        build_model(model, D_IN, HIDDEN)
        opts = ort.SessionOptions()
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        session = ort.InferenceSession(str(model), sess_options=opts, providers=["CPUExecutionProvider"])
        row = np.random.default_rng(1).standard_normal((1, D_IN), np.float32)
        targets, checks, skipped = start_servers(
            Path(tmp), model, row, session.run(None, {"input": row})[0], stack, floors=not args.no_floor
        )
        rounds = [one_round(r, targets, session, row, args.seconds) for r in range(args.rounds)]
    servers = list(targets)
    report = {
        "benchmark": "bench_tensor_peers",
        "model": {
            "layers": [D_IN, HIDDEN, HIDDEN, D_OUT],
            "dtype": "fp32",
            "multiply_adds_per_row": D_IN * HIDDEN + HIDDEN * HIDDEN + HIDDEN * D_OUT,
        },
        "servers": servers,
        "skipped": skipped,
        "method": __doc__.split("\n\n", 1)[1],
        "fleetgate_config": GATEWAY_CONFIG.format(port="P", model="mlp.onnx", options=""),
        "peer_sources": {
            "kserve": KSERVE_SERVER,
            "bentoml": BENTO_SERVICE.format(model="mlp.onnx", latency=BENTO_MAX_LATENCY_MS),
        },
        "concurrency": list(CONCURRENCY),
        "seconds_per_point": args.seconds,
        "rounds": args.rounds,
        "verify": checks,
        "median": medians(rounds, servers),
        "derived": derive(rounds, servers),
        "per_round": rounds,
        "machine": {"cpu_count": os.cpu_count(), "loadavg_before_after": [load_before, os.getloadavg()]},
        "versions": versions(servers),
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, args.out.with_suffix(".png"))
    for s in servers:
        for c in CONCURRENCY:
            m = report["median"][s][f"c{c}"]
            print(
                f"{s:9s} c={c:<2d} {m['rps']:7.1f} req/s  p50 {m['p50_ms']:7.2f} ms  p99 {m['p99_ms']:7.2f} ms"
            )
    print(json.dumps({"ort": report["median"]["ort"], **report["derived"], "skipped": skipped}, indent=1))


if __name__ == "__main__":
    main()
