"""Config hot reload: POST /admin/reload in-process, SIGHUP on a real `fleetgate serve` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gateway.config import load_config
from gateway.http.app import create_app
from router.hashing import bucket_of, pick_weighted
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
        path.write_text(_config(digits.onnx_path, TWO) + f"storage: {{cache_dir: {tmp_path / 'cache'}}}\n")
        r = httpx.post(f"{url}/admin/reload", headers=ADMIN)
        assert r.status_code == 400 and "storage changes need a restart" in r.json()["error"], r.text
        path.write_text(_config(digits.onnx_path, TWO) + "budget_alerts: {thresholds: [0.9]}\n")
        r = httpx.post(f"{url}/admin/reload", headers=ADMIN)
        assert r.status_code == 400 and "budget_alerts changes need a restart" in r.json()["error"], r.text
        assert _models(url, key) == {"digits", "digits-v2"}
        assert (
            httpx.post(f"{url}/admin/reload", headers={"Authorization": f"Bearer {key}"}).status_code == 401
        )


def test_sighup_reloads_a_running_server(tmp_path, digits):
    """Started with --port other than the file's (as `make run PORT=...` does): not a config change."""
    port, file_port = free_port(), free_port()
    path = tmp_path / "gw.yaml"
    path.write_text(_config(digits.onnx_path, ONE, file_port))
    env = {**os.environ, "FLEETGATE_ADMIN_KEY": ADMIN_KEY}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.serve.cli", "serve", "--config", str(path), "--port", str(port)],
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
        path.write_text(_config(digits.onnx_path, TWO, file_port))
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while _models(url, key) != {"digits", "digits-v2"}:
            assert time.monotonic() < deadline, "SIGHUP did not reload"
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _split_config(model: Path, weight_a: int) -> str:
    return f"""
state: {{url: "memory://"}}
tenants: {{t: {{limits: {{requests_per_minute: 100000}}}}}}
deployments:
  a: {{backend: onnxruntime, model: {model}}}
  b: {{backend: onnxruntime, model: {model}}}
models:
  digits:
    routes: [{{deployment: a, weight: {weight_a}}}, {{deployment: b, weight: {100 - weight_a}}}]
    sticky: header:x-user
"""


def test_reload_that_changes_weights_keeps_every_user_whose_bucket_did_not_move(tmp_path, digits):
    """90/10 -> 80/20 through POST /admin/reload: users keep their deployment unless their bucket
    lies in the slice that changed hands (then they move a -> b, never the other way)."""
    path = tmp_path / "gw.yaml"
    path.write_text(_split_config(digits.onnx_path, 90))
    users = [f"user-{i}" for i in range(400)]
    with serve_app(create_app(load_config(path), config_path=path)) as url:
        key = create_key(url, "t")

        def served() -> dict[str, str]:
            out = {}
            with httpx.Client(headers={"Authorization": f"Bearer {key}"}) as client:
                for user in users:
                    r = client.post(
                        f"{url}/v1/models/digits:predict",
                        json={"instances": [[0.0] * 64]},
                        headers={"x-user": user},
                    )
                    assert r.status_code == 200, r.text
                    out[user] = r.headers["x-fleetgate-deployment"].split(";")[0]
            return out

        before = served()
        path.write_text(_split_config(digits.onnx_path, 80))
        assert httpx.post(f"{url}/admin/reload", headers=ADMIN).status_code == 200
        after = served()
    for user in users:
        bucket = bucket_of("digits", user)
        assert before[user] == "ab"[pick_weighted([90, 10], bucket)]
        assert after[user] == "ab"[pick_weighted([80, 20], bucket)]
    moved = [u for u in users if before[u] != after[u]]
    assert all(before[u] == "a" and after[u] == "b" for u in moved)
    assert 0.04 < len(moved) / len(users) < 0.16
    kept = [
        u
        for u in users
        if pick_weighted([90, 10], bucket_of("digits", u)) == pick_weighted([80, 20], bucket_of("digits", u))
    ]
    assert all(before[u] == after[u] for u in kept) and len(kept) + len(moved) == len(users)
