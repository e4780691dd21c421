"""Fair-queue benchmark through the HTTP gateway: a noisy tenant floods a real ONNX Runtime deployment.

Replays `../shared/workloads/tensor-mix.jsonl` open-loop (each request is sent at t x `--time-scale`,
never waiting for earlier answers) to a running `fleetgate serve` over the Open Inference Protocol
v2 (binary tensors), one API key per tenant. One gateway process serves the same ONNX model as one
deployment per policy (`fcfs`, `vtc`, `vtc_burst` = VTC with a burst credit, `drr`), so every run
of a round hits the same process; runs are interleaved in rounds and the figures are medians.

Making the deployment the bottleneck on a shared 2-core machine: the ORT deployment runs with
`max_parallel_runs = max_concurrency = --workers` and one intra-op thread per run, and the model's
layer count is calibrated (ORT called directly, one thread) so that its capacity is
`workers / per-row time` with the quiet tenants using `--quiet-utilization` of it; the trace is
slowed by `--time-scale` so the gateway handles ~10^2 requests/s, far below what it serves on this
machine (bench/results/gateway.json). Each run records the gateway's event-loop CPU (its main
thread) and the deployment's throughput against the calibrated capacity: a saturated deployment
and an event loop well below one core mean the deployment, not the gateway, sets the pace.

Each run also splits every tenant's mean latency into stages: the wait in the fair queue (from the
gateway's own `fleetgate_queue_time_seconds`, scraped before and after the run) and everything
outside it (HTTP, decoding, admission, the runtime, the answer back).

Runs per round: the trace without the noisy tenant (`noflood`, FCFS), the full trace with each
policy, and the `split` runs: the flood split evenly between `noisy` (weight 1) and `heavy`
(weight 2), FCFS and VTC with burst credit, to show that backlogged tenants' shares follow weights.

Writes bench/results/fairness_gateway.json and .png. Run:
    .venv/bin/python -m bench.bench_fairness_gateway [--rounds 2] [--until 15] [--time-scale 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import numpy as np
import structlog

from bench.bench_fairness import (
    DIM,
    NOISY,
    QUIET,
    Record,
    TraceRequest,
    build_model,
    compare,
    load_trace,
    median_summary,
    plot,
    summarize_run,
)
from bench.bench_gateway import ADMIN_KEY, start_gateway, v2_request

ROOT = Path(__file__).resolve().parents[1]

log = structlog.get_logger("bench_fairness_gateway")

TRACE = ROOT.parent / "shared" / "workloads" / "tensor-mix.jsonl"
RESULTS = ROOT / "bench" / "results"
POLICIES = ("fcfs", "vtc", "vtc_burst", "drr")
HEAVY = "heavy"
WEIGHTS = {"alpha": 1.0, "beta": 1.0, NOISY: 1.0, HEAVY: 2.0}


# --- the deployment ---------------------------------------------------------------------------


def per_row_seconds(path: Path, tokens: int, seconds: float = 1.5) -> float:
    """Single-thread ORT time per row, rows 1..8 round robin (as the trace), run directly."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((8, DIM)).astype(np.float32)
    session.run(["Y"], {"input": x})
    rows, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        n = rows % 8 + 1
        session.run(["Y"], {"input": x[:n]})
        rows += n
    return (time.perf_counter() - started) / rows


def calibrate(workdir: Path, target_row_s: float, tokens: int) -> tuple[Path, int, float]:
    """The layer count whose single-thread time per row is near `target_row_s`."""
    probe = workdir / "probe.onnx"
    build_model(probe, layers=8, tokens=tokens, expand=True)
    layers = max(1, round(target_row_s / (per_row_seconds(probe, tokens) / 8)))
    path = workdir / "fair_mlp.onnx"
    build_model(path, layers=layers, tokens=tokens, expand=True)
    return path, layers, per_row_seconds(path, tokens)


def gateway_config(port: int, backend: str, workers: int, vtc_burst: float, split_rows: int | None = None) -> str:
    """One deployment (and one model name) per policy, all on the same backend.

    `backend` is the YAML of the deployment's backend fields (ORT file or remote upstream)."""
    deployments, models = [], []
    for name in POLICIES:
        policy = "vtc" if name == "vtc_burst" else name
        burst = vtc_burst if name == "vtc_burst" else 0.0
        deployments.append(
            f"  dep-{name}: {{{backend}, "
            f"queue: {{policy: {policy}, max_concurrency: {workers}, vtc_burst: {burst}, "
            f"max_queue_per_tenant: 256, max_queue_total: 4096, drr_quantum: 8, "
            f"split_rows: {'null' if split_rows is None else split_rows}}}}}"
        )
        models.append(f"  m-{name}: {{routes: [{{deployment: dep-{name}}}]}}")
    tenants = ", ".join(f"{t}: {{weight: {w}}}" for t, w in WEIGHTS.items())
    return (
        f"server: {{port: {port}, log_level: warning}}\n"
        'state: {url: "memory://"}\n'
        f"tenants: {{bench: {{}}, {tenants}}}\n"
        "deployments:\n" + "\n".join(deployments) + "\nmodels:\n" + "\n".join(models) + "\n"
    )


def create_keys(port: int, tenants: list[str]) -> dict[str, str]:
    import httpx

    keys = {}
    for tenant in tenants:
        r = httpx.post(
            f"http://127.0.0.1:{port}/admin/keys",
            json={"tenant": tenant},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
        r.raise_for_status()
        keys[tenant] = r.json()["key"]
    return keys


# --- the paced upstream (deployment kind `remote`) ---------------------------------------------


class PacedUpstream:
    """A minimal Open Inference Protocol v2 server (JSON) in front of real ORT, with fixed capacity.

    Each request runs the real ORT inference on one of `workers` threads, then holds the thread
    until rows x `per_row_s` have passed (as `bench_fairness.Paced`), so the deployment serves
    `workers / per_row_s` rows/s however busy the shared CPU is. Started as a subprocess.
    """

    def __init__(self, model: Path, workers: int, per_row_s: float) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = opts.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
        self.per_row_s = per_row_s
        self.pool = ThreadPoolExecutor(workers)
        self.overruns = 0

    def _run(self, x: np.ndarray) -> np.ndarray:
        started = time.perf_counter()
        y = self.session.run(["Y"], {"input": x})[0]
        left = x.shape[0] * self.per_row_s - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)
        else:
            self.overruns += 1
        return y

    async def handle(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        if method == "GET" and path.startswith("/v2/models/"):
            shape = [-1, DIM]
            return 200, {
                "name": path.rsplit("/", 1)[1],
                "platform": "onnxruntime_onnx",
                "inputs": [{"name": "input", "datatype": "FP32", "shape": shape}],
                "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, 10]}],
            }
        if method == "GET" and path == "/overruns":
            return 200, {"overruns": self.overruns}
        if method == "POST" and path.endswith("/infer"):
            req = msgspec.json.decode(body)
            inp = req["inputs"][0]
            x = np.asarray(inp["data"], np.float32).reshape(inp["shape"])
            y = await asyncio.get_running_loop().run_in_executor(self.pool, self._run, x)
            out = {"name": "Y", "datatype": "FP32", "shape": list(y.shape), "data": y.ravel().tolist()}
            return 200, {"id": req.get("id", ""), "outputs": [out]}
        return 404, {"error": "not found"}

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path, _ = head.split(b"\r\n", 1)[0].decode().split(" ", 2)
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length) if length else b""
                status, answer = await self.handle(method, path, body)
                payload = msgspec.json.encode(answer)
                writer.write(
                    f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(payload)}\r\n\r\n".encode()
                    + payload
                )
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


async def serve_upstream(port: int, model: Path, workers: int, per_row_s: float) -> None:
    upstream = PacedUpstream(model, workers, per_row_s)
    server = await asyncio.start_server(upstream.connection, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def start_upstream(model: Path, workers: int, per_row_s: float) -> tuple[subprocess.Popen[bytes], int]:
    """The paced upstream in its own process (its event loop must not share ours)."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "bench.bench_fairness_gateway", "--serve-upstream", str(port), "--model", str(model)]
    cmd += ["--workers", str(workers), "--per-row-s", repr(per_row_s)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/overruns").status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("paced upstream did not start")
        time.sleep(0.2)


# --- the client -------------------------------------------------------------------------------


class Client:
    """Open-loop HTTP/1.1 client: keep-alive connections reused when idle, new ones when all are busy."""

    def __init__(self, port: int, keys: dict[str, str]) -> None:
        self.port = port
        self.keys = keys
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._bodies: dict[tuple[str, str, int], bytes] = {}
        self._row = np.random.default_rng(1).standard_normal((8, DIM)).astype(np.float32)

    def _request(self, model: str, tenant: str, rows: int) -> bytes:
        key = (model, tenant, rows)
        if key not in self._bodies:
            self._bodies[key] = v2_request(model, self._row[:rows], self.keys[tenant], self.port)
        return self._bodies[key]

    async def send(self, model: str, tenant: str, rows: int) -> int:
        """POST one infer request; returns the HTTP status once the whole answer is read."""
        return (await self.exchange(self._request(model, tenant, rows)))[0]

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        """Send one whole HTTP/1.1 request; returns the status and the body (content-length framed)."""
        conn = self._idle.pop() if self._idle else await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = conn
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        self._idle.append(conn)
        return status, body

    def close(self) -> None:
        for _, writer in self._idle:
            writer.close()
        self._idle.clear()


async def replay(client: Client, model: str, trace: list[TraceRequest], scale: float) -> list[Record]:
    """Send each request at t x scale; latency counts from the scheduled send time."""
    records: list[Record] = []
    t0 = time.monotonic() + 0.2

    async def one(req: TraceRequest, due: float) -> None:
        status = await client.send(model, req.tenant, req.rows)
        done = time.monotonic()
        records.append(
            Record(
                tenant=req.tenant,
                rows=req.rows,
                arrival=due - t0,
                dispatched=None,
                done=done - t0,
                status="ok" if status == 200 else str(status),
            )
        )

    tasks = []
    for req in trace:
        due = t0 + req.t * scale
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, due)))
    await asyncio.gather(*tasks)
    client.close()
    return records


def thread_cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) of a process, or of one of its threads."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def split_flood(trace: list[TraceRequest]) -> list[TraceRequest]:
    """Every other noisy request is sent by `heavy` instead: two flooding tenants, equal demand."""
    out, k = [], 0
    for r in trace:
        if r.tenant == NOISY:
            k += 1
            if k % 2 == 0:
                r = TraceRequest(t=r.t, tenant=HEAVY, rows=r.rows, seed=r.seed)
        out.append(r)
    return out


def weighted_shares(records: list[Record], flood: tuple[float, float]) -> dict:
    """Rows served to `heavy` and `noisy` during the flood, and their ratio (weights say 2)."""
    rows = {
        t: sum(
            r.rows for r in records if r.tenant == t and r.status == "ok" and flood[0] <= r.done < flood[1]
        )
        for t in (NOISY, HEAVY)
    }
    return {
        "flood_rows": rows,
        "heavy_over_noisy": rows[HEAVY] / rows[NOISY] if rows[NOISY] else None,
        "weight_ratio": WEIGHTS[HEAVY] / WEIGHTS[NOISY],
    }


# --- main -------------------------------------------------------------------------------------


def run_once(
    client: Client, proc_pid: int, model: str, trace: list[TraceRequest], args: argparse.Namespace
) -> tuple[list[Record], dict]:
    """One replay, with the CPU the gateway's event loop and whole process used meanwhile."""
    started = time.monotonic()
    deployment = "dep-" + model.removeprefix("m-")
    queue0 = queue_waits(client.port, deployment)
    loop0, proc0, me0 = thread_cpu_s(proc_pid, proc_pid), thread_cpu_s(proc_pid), time.process_time()
    records = asyncio.run(replay(client, model, trace, args.time_scale))
    wall = time.monotonic() - started
    cpu = {
        "gateway_event_loop_cores": (thread_cpu_s(proc_pid, proc_pid) - loop0) / wall,
        "gateway_process_cores": (thread_cpu_s(proc_pid) - proc0) / wall,
        "load_generator_cores": (time.process_time() - me0) / wall,
        "wall_s": wall,
        "stages": stage_times(records, queue0, queue_waits(client.port, deployment)),
    }
    return records, cpu


def queue_waits(port: int, deployment: str) -> dict[str, tuple[float, float]]:
    """tenant -> (seconds waited in the deployment's fair queue, requests), from the gateway's /metrics."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).text
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for kind, index in (("_sum", 0), ("_count", 1)):
            prefix = f'fleetgate_queue_time_seconds{kind}{{deployment="{deployment}",tenant="'
            if line.startswith(prefix):
                tenant = line[len(prefix) :].split('"', 1)[0]
                out.setdefault(tenant, [0.0, 0.0])[index] = float(line.rsplit(" ", 1)[1])
    return {t: (v[0], v[1]) for t, v in out.items()}


def stage_times(
    records: list[Record], before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, dict[str, float]]:
    """Per tenant, mean ms: end to end (client), waiting in the fair queue (server), and the rest
    (HTTP, decode, admission, the runtime itself, the answer back)."""
    out = {}
    for tenant in sorted({r.tenant for r in records}):
        ok = [r.latency for r in records if r.tenant == tenant and r.status == "ok"]
        waited, count = (after.get(tenant, (0.0, 0.0))[i] - before.get(tenant, (0.0, 0.0))[i] for i in (0, 1))
        if not ok or not count:
            continue
        end_to_end = 1e3 * sum(ok) / len(ok)
        queue = 1e3 * waited / count
        out[tenant] = {
            "end_to_end_ms_mean": end_to_end,
            "fair_queue_wait_ms_mean": queue,
            "outside_the_queue_ms_mean": end_to_end - queue,
        }
    return out


def make_deployment(
    args: argparse.Namespace, workdir: Path, quiet_rows_s: float
) -> tuple[str, dict, subprocess.Popen[bytes] | None]:
    """The backend YAML of every policy's deployment, its facts, and the upstream process if any.

    `paced` (default): a `remote` deployment on a paced ORT upstream of fixed capacity; `ort`: an
    `onnxruntime` deployment in the gateway, CPU-bound (capacity is whatever the cores give)."""
    per_row_s = args.workers * args.quiet_utilization / quiet_rows_s  # sets the capacity
    if args.deployment == "ort":
        model, layers, row_s = calibrate(workdir, per_row_s, args.tokens)
        backend = (
            f"backend: onnxruntime, model: {model}, "
            f"options: {{intra_op_threads: 1, max_parallel_runs: {args.workers}}}"
        )
        info = {"layers": layers, "per_row_ms_one_thread": row_s * 1e3}
        return backend, info | {"capacity_rows_s": args.workers / row_s}, None
    # the real compute is about a tenth of the paced time, so CPU contention rarely overruns it
    model, layers, row_s = calibrate(workdir, per_row_s * 0.1, args.tokens)
    upstream, up_port = start_upstream(model, args.workers, per_row_s)
    backend = (
        f"backend: remote, url: 'http://127.0.0.1:{up_port}', protocol: kserve_v2, "
        f"model_name: fair, timeout_s: 120, options: {{max_connections: {4 * args.workers}}}"
    )
    info = {"layers": layers, "per_row_ms_one_thread": row_s * 1e3, "per_row_ms_paced": per_row_s * 1e3}
    return backend, info | {"capacity_rows_s": args.workers / per_row_s, "upstream_port": up_port}, upstream


def upstream_overruns(info: dict) -> int:
    import httpx

    port = info.get("upstream_port")
    return httpx.get(f"http://127.0.0.1:{port}/overruns").json()["overruns"] if port else 0


def run_rounds(args: argparse.Namespace, port: int, pid: int, trace: list[TraceRequest], info: dict) -> tuple:
    """All runs of all rounds against the running gateway; returns (rounds, last records)."""
    flood = info["flood_window_s"]
    keys = create_keys(port, [*QUIET, NOISY, HEAVY])
    client = Client(port, keys)
    asyncio.run(replay(client, "m-fcfs", trace[:50], 0.5))  # warm-up: connections, first calls
    plan = [("noflood", "fcfs", [r for r in trace if r.tenant != NOISY], None)]
    plan += [(p, p, trace, None) for p in POLICIES]
    plan += [
        ("fcfs_split", "fcfs", split_flood(trace), WEIGHTS),
        ("vtc_split", "vtc_burst", split_flood(trace), WEIGHTS),
    ]
    rounds, records = [], {}
    for rnd in range(args.rounds):
        runs = {}
        for name, policy, requests, weights in plan:
            overruns = upstream_overruns(info)
            records[name], cpu = run_once(client, pid, f"m-{policy}", requests, args)
            run = runs[name] = summarize_run(records[name], flood, policy, weights) | cpu
            run["paced_overruns"] = upstream_overruns(info) - overruns
            run["deployment_utilization"] = run["flood_throughput_rows_s"] / info["capacity_rows_s"]
            if weights:
                run["weighted_shares"] = weighted_shares(records[name], flood)
            run["cpu_cores_used"] = cpu["gateway_process_cores"]
            ok_rows = sum(r.rows for r in records[name] if r.status == "ok")
            run["rows_per_cpu_s"] = ok_rows / max(1e-9, cpu["gateway_process_cores"] * cpu["wall_s"])
            log.info("run done", round=rnd, run=name, **{k: round(v, 3) for k, v in cpu.items() if k != "stages"})
        rounds.append(runs)
    return rounds, records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--deployment", choices=["paced", "ort"], default="paced")
    parser.add_argument("--time-scale", type=float, default=2.0, help="stretch arrival times by this")
    parser.add_argument("--until", type=float, default=15.0, help="replay only t < UNTIL (trace seconds)")
    parser.add_argument("--workers", type=int, default=2, help="parallel runs = queue max_concurrency")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per row made inside the model")
    parser.add_argument("--quiet-utilization", type=float, default=0.3)
    parser.add_argument("--vtc-burst", type=float, default=None, help="rows (default workers x 32: about seven mean requests of the trace)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--split-rows", type=int, default=0, help="queue.split_rows of every deployment (0: off)"
    )
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/fairness_gateway[_ort]")
    parser.add_argument("--serve-upstream", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--per-row-s", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream is not None:
        asyncio.run(serve_upstream(args.serve_upstream, args.model, args.workers, args.per_row_s))
        return
    out: Path = args.out or RESULTS / (
        "fairness_gateway" if args.deployment == "paced" else "fairness_gateway_ort"
    )
    burst = args.vtc_burst if args.vtc_burst is not None else 32.0 * args.workers

    trace = [r for r in load_trace(args.trace) if r.t < args.until]
    span = max(r.t for r in trace) * args.time_scale
    quiet_rows_s = sum(r.rows for r in trace if r.tenant in QUIET) / span
    noisy_t = [r.t * args.time_scale for r in trace if r.tenant == NOISY]
    flood = (min(noisy_t), max(noisy_t))

    upstream = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            backend, info, upstream = make_deployment(args, Path(tmp), quiet_rows_s)
            info["flood_window_s"] = flood
            log.info("deployment ready", **info)
            proc, port, _ = start_gateway(
                Path(tmp), lambda p: gateway_config(p, backend, args.workers, burst, args.split_rows or None)
            )
            try:
                rounds, records = run_rounds(args, port, proc.pid, trace, info)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        finally:
            if upstream is not None:
                upstream.terminate()
                upstream.wait(timeout=30)

    per_round = [compare(runs, QUIET) for runs in rounds]
    result = {
        "trace": str(args.trace),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": {
            "deployment": args.deployment,
            "time_scale": args.time_scale,
            "until_trace_s": args.until,
            "workers": args.workers,
            "vtc_burst_rows": burst,
            "split_rows": args.split_rows or None,
            "weights": WEIGHTS,
            "quiet_demand_rows_s": quiet_rows_s,
            "tokens_per_row": args.tokens,
            "deployment_info": info,
        },
        "summary_median_of_rounds": median_summary(per_round),
        "weighted_shares_median": {
            name: float(np.median([r[name]["weighted_shares"]["heavy_over_noisy"] for r in rounds]))
            for name in ("fcfs_split", "vtc_split")
        },
        "summary_per_round": per_round,
        "rounds": rounds,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(records, flood, out.with_suffix(".png"))
    log.info("wrote", json=str(out.with_suffix(".json")), summary=result["summary_median_of_rounds"])


if __name__ == "__main__":
    main()
