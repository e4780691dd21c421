"""Router fault recovery: one of two upstream fleetgates dies under load and comes back.

Three `fleetgate serve` processes: two upstreams (`up-a`, `up-b`) serving the digits model with
ONNX Runtime, and a front gateway whose model `digits` splits 50/50 over two `remote` kserve_v2
deployments pointing at them. Four client threads keep the front busy with v2 infer requests.
Each repetition SIGKILLs `up-a`, keeps the load on for a while (every request must still succeed,
on `up-b`), restarts `up-a` on the same port and measures the recovery time: from the moment the
restarted upstream answers `/health/ready` until the front serves a request on it again. That time
is governed by the front's circuit-breaker cool-down (`breakers.cooldown_s`; a half-open probe is
let through when it ends).

Writes bench/results/router_recovery.json (median over the repetitions).
Run: `.venv/bin/python -m bench.bench_router_recovery [--repetitions 5] [--cooldown 0.5]`.
The test tests/gateway/test_fault_recovery.py runs one repetition of the same scenario.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
ADMIN_KEY = "recovery-admin-key-0123456789"
ROW = [float(i % 17) for i in range(64)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One `fleetgate serve` process on a fixed port (so it can be restarted where it was)."""

    name: str
    config: Path
    port: int
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = (self.config.parent / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.serve.cli", "serve", "--config", str(self.config)],
            cwd=ROOT,
            env={"FLEETGATE_GRPC_PORT": "off", **os.environ, "FLEETGATE_ADMIN_KEY": ADMIN_KEY, **self.env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def wait_ready(self, timeout_s: float = 120.0) -> float:
        """Block until `/health/ready` answers 200; returns that moment (monotonic)."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=1.0) as client:
            while True:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    tail = (self.config.parent / f"{self.name}.log").read_text()[-2000:]
                    raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {tail}")
                try:
                    if client.get(f"{self.url}/health/ready").status_code == 200:
                        return time.monotonic()
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} not ready in {timeout_s} s")
                time.sleep(0.01)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self.proc = None

    def create_key(self, tenant: str) -> str:
        r = httpx.post(
            f"{self.url}/admin/keys",
            json={"tenant": tenant},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
        r.raise_for_status()
        return r.json()["key"]


def _upstream_yaml(model: Path, port: int, state: Path) -> str:
    return f"""
server: {{port: {port}, log_level: warning}}
state: {{url: "sqlite:///{state}"}}
tenants: {{fleet: {{}}}}
deployments:
  digits: {{backend: onnxruntime, model: {model}}}
models:
  digits: {{routes: [{{deployment: digits}}]}}
"""


def _front_yaml(port: int, upstreams: list[Server], cooldown_s: float, failure_threshold: int) -> str:
    deployments = "\n".join(
        f"  {u.name}: {{backend: remote, url: {u.url}, protocol: kserve_v2, model_name: digits, "
        f"api_key_env: RECOVERY_KEY_{i}, timeout_s: 10}}"
        for i, u in enumerate(upstreams)
    )
    routes = ", ".join(f"{{deployment: {u.name}, weight: 50}}" for u in upstreams)
    return f"""
server: {{port: {port}, log_level: warning}}
state: {{url: "memory://"}}
tenants: {{bench: {{}}}}
breakers: {{failure_threshold: {failure_threshold}, cooldown_s: {cooldown_s}}}
deployments:
{deployments}
models:
  digits: {{routes: [{routes}], sticky: none}}
"""


@dataclass
class Fleet:
    front: Server
    upstreams: list[Server]
    key: str


@contextmanager
def fleet(model: Path, workdir: Path, cooldown_s: float, failure_threshold: int = 2) -> Iterator[Fleet]:
    """Two upstream fleetgates and a front gateway routing 50/50 over them; stopped on exit."""
    upstreams = []
    for name in ("up-a", "up-b"):
        port = free_port()
        config = workdir / f"{name}.yaml"
        config.write_text(_upstream_yaml(model, port, workdir / f"{name}.db"))
        upstreams.append(Server(name, config, port))
    front = Server("front", workdir / "front.yaml", free_port())
    front.config.write_text(_front_yaml(front.port, upstreams, cooldown_s, failure_threshold))
    try:
        for u in upstreams:
            u.start()
        for i, u in enumerate(upstreams):
            u.wait_ready()
            front.env[f"RECOVERY_KEY_{i}"] = u.create_key("fleet")  # kept in the upstream's SQLite
        front.start()
        front.wait_ready()
        yield Fleet(front, upstreams, front.create_key("bench"))
    finally:  # all drain at once (each waits out its drain grace), then each is reaped
        for server in (front, *upstreams):
            if server.proc is not None and server.proc.poll() is None:
                server.proc.send_signal(signal.SIGTERM)
        for server in (front, *upstreams):
            if server.proc is not None:
                try:
                    server.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    server.stop()
                server.proc = None


@dataclass
class Result:
    at: float
    status: int
    deployment: str


class Load:
    """Client threads sending v2 infer requests to the front until stopped; every result is kept."""

    def __init__(self, fleet_: Fleet, workers: int = 4) -> None:
        self._fleet = fleet_
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.results: list[Result] = []
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def _run(self) -> None:
        body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": ROW}]}
        url = f"{self._fleet.front.url}/v2/models/digits/infer"
        with httpx.Client(headers={"Authorization": f"Bearer {self._fleet.key}"}, timeout=30) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(url, json=body)
                    result = Result(
                        time.monotonic(), r.status_code, r.headers.get("x-fleetgate-deployment", "")
                    )
                except httpx.HTTPError as exc:
                    result = Result(time.monotonic(), 0, type(exc).__name__)
                with self._lock:
                    self.results.append(result)

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=30)

    def since(self, t: float) -> list[Result]:
        with self._lock:
            return [r for r in self.results if r.at >= t]

    def wait_served_by(self, deployment: str, since: float, timeout_s: float = 60.0) -> float:
        """The moment the first request after `since` was answered by `deployment`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hits = [r.at for r in self.since(since) if r.deployment.split(";")[0] == deployment]
            if hits:
                return min(hits)
            time.sleep(0.005)
        raise TimeoutError(f"{deployment} served nothing within {timeout_s} s")


@dataclass
class Repetition:
    outage_requests: int
    outage_failures: int
    restart_to_ready_s: float
    recovery_s: float


def kill_and_recover(fleet_: Fleet, load: Load, outage_s: float = 1.5) -> Repetition:
    """SIGKILL up-a under load, keep the load on for `outage_s`, restart it, time its recovery."""
    victim = fleet_.upstreams[0]
    load.wait_served_by(victim.name, time.monotonic())  # it is in service before the fault
    killed = time.monotonic()
    victim.stop(signal.SIGKILL)
    time.sleep(outage_s)
    restarted = time.monotonic()
    victim.start()
    ready = victim.wait_ready()
    back = load.wait_served_by(victim.name, ready)
    during = [r for r in load.since(killed) if r.at <= back]
    return Repetition(
        outage_requests=len(during),
        outage_failures=sum(r.status != 200 for r in during),
        restart_to_ready_s=ready - restarted,
        recovery_s=back - ready,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--cooldown", type=float, default=0.5, help="breakers.cooldown_s of the front")
    parser.add_argument("--out", type=Path, default=RESULTS / "router_recovery.json")
    args = parser.parse_args()
    from backends.demo_models.digits import write_digits

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = write_digits(work / "models").onnx_path
        with fleet(model, work, cooldown_s=args.cooldown) as fleet_, Load(fleet_) as load:
            reps = [kill_and_recover(fleet_, load) for _ in range(args.repetitions)]
            total = len(load.results)
            failed = sum(r.status != 200 for r in load.results)
    recovery = [r.recovery_s for r in reps]
    result = {
        "scenario": "SIGKILL one of two remote kserve_v2 upstream fleetgates under 4-thread load, restart it",
        "breakers": {"failure_threshold": 2, "cooldown_s": args.cooldown},
        "repetitions": [r.__dict__ for r in reps],
        "recovery_s_median": statistics.median(recovery),
        "recovery_s_max": max(recovery),
        "restart_to_ready_s_median": statistics.median(r.restart_to_ready_s for r in reps),
        "requests_total": total,
        "requests_failed": failed,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    from bench.plots import plot_router_recovery  # the PNG beside the JSON (bench/plots.py)

    plot_router_recovery(result, args.out.with_suffix(".png"))
    sys.stdout.write(json.dumps({k: v for k, v in result.items() if k != "repetitions"}, indent=2) + "\n")


if __name__ == "__main__":
    main()
