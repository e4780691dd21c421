"""`fleetgate serve` re-executes itself on Intel's OpenMP runtime when a torch_llm engine may run on
the CPU (gateway/serve/openmp.py), keeps its PID and arguments, and leaves other configs alone."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from backends.demo_models.tiny_llama import write_tiny_llama
from gateway.config import parse_config
from gateway.serve.openmp import intel_openmp_library, wants_intel_openmp
from tests.tenancy.conftest import start_gateway, wait_ready


def _config(deployments: str):  # type: ignore[no-untyped-def]
    return parse_config(f"deployments:\n{deployments}\n" if deployments else "{}", base_dir=Path("."))


def test_only_cpu_llm_engines_want_it(tmp_path: Path) -> None:
    folder = write_tiny_llama(tmp_path / "m")
    cpu = _config(f"  llm: {{backend: torch_llm, model: {folder}, device: cpu}}")
    auto = _config(f"  llm: {{backend: torch_llm, model: {folder}}}")
    gpu = _config(f"  llm: {{backend: torch_llm, model: {folder}, device: 'cuda:0'}}")
    assert wants_intel_openmp(cpu, {}) and wants_intel_openmp(auto, {})
    assert not wants_intel_openmp(gpu, {})
    assert not wants_intel_openmp(_config(""), {})
    assert not wants_intel_openmp(cpu, {"FLEETGATE_OPENMP": "gnu"})
    assert not wants_intel_openmp(cpu, {"LD_PRELOAD": "/opt/lib/libiomp5.so"})


@pytest.mark.skipif(intel_openmp_library() is None, reason="intel-openmp is not installed here")
def test_serve_runs_on_intel_openmp_and_answers(tmp_path: Path) -> None:
    folder = write_tiny_llama(tmp_path / "m")
    config = tmp_path / "c.yaml"
    config.write_text(
        f"state: {{url: 'memory://'}}\ndeployments:\n  llm: {{backend: torch_llm, model: {folder}, device: cpu}}\n"
        "models:\n  tiny: {routes: [{deployment: llm}]}\n"
    )
    gw = start_gateway(config, tmp_path / "gw.log")
    try:
        wait_ready(gw, timeout_s=120)
        maps = Path(f"/proc/{gw.proc.pid}/maps").read_text()
        assert "libiomp5.so" in maps, "the serving process (same PID) must have Intel's runtime loaded"
        assert httpx.get(f"{gw.url}/health/ready").status_code == 200
    finally:
        gw.kill()
    assert "restarting on Intel's OpenMP runtime" in (tmp_path / "gw.log").read_text()
