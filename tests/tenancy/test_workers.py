"""`server.workers: 2`: two processes on one port share keys and limits exactly; /metrics sums them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.tenancy.conftest import (
    ADMIN_HEADERS,
    admin_create_key,
    bearer,
    gateway_processes,
    v2_body,
    write_config,
)

RPM = 30


def test_two_workers_share_one_port_keys_and_limits(digits, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    config = write_config(
        tmp_path / "workers.yaml",
        f"""
server: {{workers: 2, drain_grace_s: 0}}
state: {{url: "sqlite:///{tmp_path / 'state.db'}"}}
tenants: {{t: {{quotas: {{requests_per_day: {RPM}}}}}}}
deployments: {{digits: {{backend: onnxruntime, model: {digits.onnx_path}}}}}
models: {{digits: {{routes: [{{deployment: digits}}]}}}}
""",
    )
    with gateway_processes([config], tmp_path) as (gw,):
        key, _ = admin_create_key(gw.url, "t")
        statuses = []
        for _ in range(2 * RPM):
            # a new connection each time, so the kernel spreads them over both workers
            with httpx.Client() as client:
                statuses.append(
                    client.post(f"{gw.url}/v2/models/digits/infer", json=v2_body(), headers=bearer(key)).status_code
                )
        assert statuses.count(200) == RPM and statuses.count(429) == RPM  # the quota, exact across workers
        text = httpx.get(f"{gw.url}/metrics", headers=ADMIN_HEADERS).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        served = sum(
            s.value
            for s in families["fleetgate_requests"].samples
            if s.name == "fleetgate_requests_total" and s.labels.get("protocol") == "v2"
        )
        assert served == 2 * RPM  # every worker's requests, summed
        pids = {s.labels["pid"] for s in families["fleetgate_backend_ready"].samples}
        assert len(pids) == 2  # two workers, each with its own runtime

        os.kill(int(next(iter(pids))), signal.SIGKILL)  # a worker dies: the parent replaces it
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with httpx.Client() as client:
                assert client.get(f"{gw.url}/health/live").status_code == 200  # the other one serves
            text = httpx.get(f"{gw.url}/metrics", headers=ADMIN_HEADERS).text
            ready = {
                s.labels["pid"]
                for f in text_string_to_metric_families(text) if f.name == "fleetgate_backend_ready"
                for s in f.samples if s.value == 1 and s.labels["pid"] not in pids
            }  # fmt: skip
            if ready:
                break
            time.sleep(0.5)
        assert ready, "no replacement worker came up"
        gauges = {
            s.labels["pid"]
            for f in text_string_to_metric_families(httpx.get(f"{gw.url}/metrics", headers=ADMIN_HEADERS).text)
            if f.name == "fleetgate_backend_ready" for s in f.samples
        }  # fmt: skip
        assert len(gauges) == 2  # the dead worker's gauges are gone, not summed into the view forever
        gw.kill(signal.SIGTERM)
        assert gw.proc.returncode == 0


def test_workers_refuse_a_memory_state(tmp_path: Path) -> None:
    from gateway.config import ConfigError, parse_config

    try:
        parse_config("server: {workers: 2}\nstate: {url: 'memory://'}\n", base_dir=tmp_path)
    except ConfigError as exc:
        assert "shared state" in str(exc) and "$.state.url" in str(exc)
    else:
        raise AssertionError("a memory:// state with two workers was accepted")
