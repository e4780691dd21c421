"""Third-party start-up noise: ONNX Runtime's failed CUDA provider load on a machine without a GPU
and TensorFlow's CUDA probe become one fleetgate log line (or a debug line), not stderr lines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from backends.onnxruntime import providers_to_ask
from backends.runtime.cuda_devices import cuda_device_count
from tests.servers import free_port

ROOT = Path(__file__).resolve().parents[2]
CUDA_FIRST = ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_cuda_providers_are_asked_for_only_with_a_cuda_device() -> None:
    assert providers_to_ask(CUDA_FIRST, cuda_devices=0) == ["CPUExecutionProvider"]
    assert providers_to_ask(["TensorrtExecutionProvider"], cuda_devices=0) == ["CPUExecutionProvider"]
    assert providers_to_ask(CUDA_FIRST, cuda_devices=1) == CUDA_FIRST
    assert providers_to_ask(["OpenVINOExecutionProvider"], cuda_devices=0) == ["OpenVINOExecutionProvider"]


@pytest.mark.skipif(cuda_device_count() > 0, reason="the noise is what a machine without a GPU printed")
def test_serve_with_cuda_providers_on_a_cpu_machine_logs_one_warning(digits, tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("onnxruntime")
    port = free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"""
server: {{port: {port}, grpc_port: null}}
state: {{url: "memory://"}}
deployments:
  d: {{backend: onnxruntime, model: {digits.onnx_path}, providers: [{", ".join(CUDA_FIRST)}]}}
models:
  digits: {{routes: [{{deployment: d}}]}}
"""
    )
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.serve.cli", "serve", "--config", str(config)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    lines = log.read_text().splitlines()
    assert not [line for line in lines if ":onnxruntime:" in line], "ONNX Runtime wrote its own log lines"
    warnings = [line for line in lines if "onnx_providers_unavailable" in line]
    assert len(warnings) == 1 and '"level":"warning"' in warnings[0]
    assert "no CUDA device visible" in warnings[0] and '"got":["CPUExecutionProvider"]' in warnings[0]


def test_tensorflow_import_prints_nothing_on_stderr() -> None:
    pytest.importorskip("tensorflow_serving")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # as an operator starts it
    out = subprocess.run(
        [sys.executable, "-c", "from backends.tfserving.rpc import load_apis; load_apis()"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr == ""
