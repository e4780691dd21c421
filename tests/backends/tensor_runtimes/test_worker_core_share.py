"""Runtimes left at their default thread count take one worker's share of the cores under
`server.workers` (`backends/cores.py`); a count set in the options is taken as given."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from backends.cores import WORKERS_ENV, available_cores, cores_per_worker, default_threads, sharing_workers
from backends.registry import create_backend
from backends.spec import DeploymentSpec
from gateway.serve.workers import prepare_environment


@pytest.mark.parametrize(
    ("value", "workers"),
    [(None, 1), ("2", 2), ("3", 3), (" 2", 2), ("0", 1), ("-2", 1), ("two", 1), ("²", 1)],
)
def test_the_workers_sharing_the_cores_come_from_the_supervisor(monkeypatch, value, workers) -> None:  # noqa: ANN001
    if value is None:
        monkeypatch.delenv(WORKERS_ENV, raising=False)
    else:
        monkeypatch.setenv(WORKERS_ENV, value)
    assert sharing_workers() == workers
    assert cores_per_worker() == max(1, available_cores() // workers)
    assert default_threads() == (None if workers == 1 else cores_per_worker())


def test_the_supervisor_tells_its_workers_how_many_they_are(tmp_path) -> None:  # noqa: ANN001
    before = dict(os.environ)
    with mock.patch.dict(os.environ, {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}):  # restored after
        prepare_environment(str(tmp_path / "gateway.yaml"), {}, 4)
        assert sharing_workers() == 4
    assert dict(os.environ) == before  # nothing leaks into the tests after this one


async def _loaded(digits_onnx, **options: object):  # noqa: ANN001, ANN202
    backend = create_backend(
        "ort", DeploymentSpec(backend="onnxruntime", model=str(digits_onnx), options=options)
    )
    await backend.load()
    return backend


@pytest.mark.parametrize("workers", [1, 2, 64])
async def test_onnx_runtime_defaults_to_one_workers_share(digits_onnx, monkeypatch, workers: int) -> None:  # noqa: ANN001
    monkeypatch.setenv(WORKERS_ENV, str(workers))
    backend = await _loaded(digits_onnx)
    try:
        threads = backend._session.get_session_options().intra_op_num_threads
        # 0 is ONNX Runtime's own default (a thread per core), kept without workers
        assert threads == (0 if workers == 1 else max(1, available_cores() // workers))
        assert backend.runs_in_flight == 1
    finally:
        await backend.close()


async def test_threads_set_in_the_options_win_and_runs_fill_only_this_workers_cores(
    digits_onnx,
    monkeypatch,  # noqa: ANN001
) -> None:
    monkeypatch.setenv(WORKERS_ENV, "2")
    backend = await _loaded(digits_onnx, intra_op_threads=1)
    try:
        assert backend._session.get_session_options().intra_op_num_threads == 1
        # one run per core of this worker's share, not of the whole machine's
        assert backend.runs_in_flight == max(1, available_cores() // 2)
    finally:
        await backend.close()


def test_openvino_on_the_cpu_defaults_to_one_workers_share(monkeypatch) -> None:  # noqa: ANN001
    pytest.importorskip("openvino")
    from backends.openvino.backend import OpenVINOBackend
    from backends.openvino.options import OpenVINOOptions

    def config(device: str, **options: object) -> dict:
        spec = DeploymentSpec(backend="openvino", model="unused.xml", device=device)
        return OpenVINOBackend("ov", spec, OpenVINOOptions(**options))._compile_config()

    monkeypatch.delenv(WORKERS_ENV, raising=False)
    assert "INFERENCE_NUM_THREADS" not in config("CPU")
    monkeypatch.setenv(WORKERS_ENV, "2")
    assert config("CPU")["INFERENCE_NUM_THREADS"] == cores_per_worker()
    assert config("CPU", num_threads=3)["INFERENCE_NUM_THREADS"] == 3
    assert "INFERENCE_NUM_THREADS" not in config("GPU")  # not a CPU property
