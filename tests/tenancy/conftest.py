"""Fixtures of the gateway-level tenancy tests: configs with private models, gateways in processes.

In-process gateways (tests.servers.serve_app) serve the isolation and rate-limit tests; the replica
and durability tests run real `python -m gateway.serve.cli serve` processes, so a SIGKILL and a second
process sharing Redis are the real thing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from backends.demo_models.digits import DigitsModel, digits_split
from tests.conftest import ADMIN_KEY
from tests.policies.conftest import redis_url  # noqa: F401 - re-exported fixture (real redis-server)
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
#: a well-formed key that no store has ever seen
UNKNOWN_KEY = "fg-0123456789ab-" + "A" * 43


def deployments_yaml(digits: DigitsModel, upstream_url: str) -> str:
    """Two deployments: the digits ONNX model and the OpenAI echo upstream (remote backend)."""
    return f"""
deployments:
  digits:
    backend: onnxruntime
    model: {digits.onnx_path}
  echo:
    backend: remote
    url: {upstream_url}
    protocol: openai
    model_name: echo-upstream
    api_key_env: TEST_UPSTREAM_KEY
"""


def models_yaml(tensor_models: list[str], chat_models: list[str]) -> str:
    lines = ["models:"]
    lines += [f"  {m}: {{routes: [{{deployment: digits}}]}}" for m in tensor_models]
    lines += [f"  {m}: {{routes: [{{deployment: echo}}]}}" for m in chat_models]
    return "\n".join(lines) + "\n"


def write_config(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def v2_body(rows: int = 1) -> dict[str, object]:
    x = digits_split()[1][:rows]
    return {
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]
    }


def tf_body(rows: int = 1) -> dict[str, object]:
    x: np.ndarray = digits_split()[1][:rows]
    return {"instances": x.tolist()}


def chat_body(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 3}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def admin_create_key(url: str, tenant: str, **extra: object) -> tuple[str, str]:
    """(secret, key_id) of a new key, made through POST /admin/keys."""
    r = httpx.post(f"{url}/admin/keys", json={"tenant": tenant, **extra}, headers=ADMIN_HEADERS)
    assert r.status_code == 201, r.text
    body = r.json()
    return body["key"], body["key_id"]


@dataclass
class GatewayProcess:
    """A `python -m gateway.serve.cli serve` child process."""

    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig`; a process that has not exited 10 s later is killed."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


def start_gateway(config: Path, log: Path) -> GatewayProcess:
    """Start a gateway process on a free port (does not wait for it)."""
    port = free_port()
    env = {**os.environ, "FLEETGATE_ADMIN_KEY": ADMIN_KEY, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = log.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.serve.cli", "serve", "--config", str(config), "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    out.close()
    return GatewayProcess(proc, f"http://127.0.0.1:{port}", log)


def wait_ready(gw: GatewayProcess, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if gw.proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {gw.proc.returncode}: {gw.log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{gw.url}/health/ready", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"gateway not ready in {timeout_s} s: {gw.log.read_text()[-3000:]}")
        time.sleep(0.05)


@contextmanager
def gateway_processes(configs: list[Path], logs_dir: Path) -> Iterator[list[GatewayProcess]]:
    """Start one gateway per config (in parallel), wait until all are ready, stop them after."""
    gws = [start_gateway(c, logs_dir / f"gateway-{i}.log") for i, c in enumerate(configs)]
    try:
        for gw in gws:
            wait_ready(gw)
        yield gws
    finally:
        # every one drains at once (each waits out its drain grace, 5 s by default), then each is reaped
        for gw in gws:
            if gw.proc.poll() is None:
                os.kill(gw.proc.pid, signal.SIGTERM)
        for gw in gws:
            try:
                gw.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                gw.kill()
