"""Config hot reload: POST /admin/reload in-process, SIGHUP on a real `fleetgate serve` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gateway.app import create_app
from gateway.config import load_config
from tests.conftest import ADMIN_KEY, create_key
from tests.servers import free_port, serve_app

ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def _config(model: Path, models: str, port: int = 8000) -> str:
    return f"""
server: {{port: {port}}}
state: {{url: "memory://"}}
tenants: {{t: {{}}}}
deployments:
  a: {{backend: onnxruntime, model: {model}}}
models:
{models}
"""


ONE = "  digits: {routes: [{deployment: a}]}"
TWO = ONE + "\n  digits-v2: {routes: [{deployment: a}]}"


def _models(url: str, key: str) -> set[str]:
    return {
        m["id"]
        for m in httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"]
    }


def test_admin_reload_applies_and_refuses_bad_configs(tmp_path, digits):
    path = tmp_path / "gw.yaml"
    path.write_text(_config(digits.onnx_path, ONE))
    with serve_app(create_app(load_config(path), config_path=path)) as url:
        key = create_key(url, "t")
        assert _models(url, key) == {"digits"}
        path.write_text(_config(digits.onnx_path, TWO))
        r = httpx.post(f"{url}/admin/reload", headers=ADMIN)
        assert r.status_code == 200, r.text
        assert _models(url, key) == {"digits", "digits-v2"}

        path.write_text(
            _config(digits.onnx_path, TWO).replace("tenants: {t: {}}", "tenants: {t: {weight: -1}}")
        )
        r = httpx.post(f"{url}/admin/reload", headers=ADMIN)
        assert r.status_code == 400 and "the running one stays" in r.json()["error"]
        path.write_text(
            _config(digits.onnx_path, TWO)
            .replace("deployment: a}", "deployment: b}")
            .replace("  a: {backend", "  b: {backend")
        )
        r = httpx.post(f"{url}/admin/reload", headers=ADMIN)
        assert r.status_code == 400 and "deployment changes need a restart" in r.json()["error"]
        assert _models(url, key) == {"digits", "digits-v2"}
        assert (
            httpx.post(f"{url}/admin/reload", headers={"Authorization": f"Bearer {key}"}).status_code == 401
        )


def test_sighup_reloads_a_running_server(tmp_path, digits):
    port = free_port()
    path = tmp_path / "gw.yaml"
    path.write_text(_config(digits.onnx_path, ONE, port))
    env = {**os.environ, "FLEETGATE_ADMIN_KEY": ADMIN_KEY}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            time.sleep(0.2)
        key = create_key(url, "t")
        assert _models(url, key) == {"digits"}
        path.write_text(_config(digits.onnx_path, TWO, port))
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while _models(url, key) != {"digits", "digits-v2"}:
            assert time.monotonic() < deadline, "SIGHUP did not reload"
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
