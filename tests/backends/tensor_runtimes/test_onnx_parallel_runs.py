"""How many ONNX Runtime runs (batches) a deployment lets execute at once (`parallel_runs`)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from backends.base import Tensor, TensorRequest
from backends.onnxruntime import GPU_PARALLEL_RUNS, OnnxOptions, device_of, parallel_runs
from backends.registry import create_backend
from backends.spec import BatchingSpec, DeploymentSpec


@pytest.mark.parametrize(
    ("options", "on_cpu", "cores", "runs"),
    [
        ({}, True, 2, 1),  # ORT's default threads already use every core: one run at a time
        ({}, True, 16, 1),
        ({"intra_op_threads": 1}, True, 4, 4),  # one run per core
        ({"intra_op_threads": 2}, True, 5, 2),
        ({"intra_op_threads": 8}, True, 2, 1),  # more threads than cores: still one run
        ({"max_parallel_runs": 3}, True, 2, 3),  # what the config says wins
        ({}, False, 2, GPU_PARALLEL_RUNS),
        ({"max_parallel_runs": 1}, False, 2, 1),
    ],
)
def test_runs_in_flight_fill_the_cores_without_oversubscribing_them(options, on_cpu, cores, runs) -> None:
    assert parallel_runs(OnnxOptions(**options), on_cpu, cores) == runs


@pytest.mark.parametrize("option", ["max_parallel_runs", "intra_op_threads"])
def test_a_negative_count_is_refused_with_its_name(digits_onnx, option: str) -> None:
    with pytest.raises(ValueError, match=f"{option} must be >= 0"):
        create_backend(
            "ort", DeploymentSpec(backend="onnxruntime", model=str(digits_onnx), options={option: -1})
        )


async def _batched(digits_onnx, **options: object):  # noqa: ANN001, ANN202
    spec = DeploymentSpec(
        backend="onnxruntime",
        model=str(digits_onnx),
        options={"inline_below_us": 0, "inline_alone_below_us": 0, **options},
        batching=BatchingSpec(max_batch_size=64, max_delay_ms=2),
    )
    backend = create_backend("ort", spec)
    await backend.load()
    await backend.warmup()
    return backend


@pytest.mark.parametrize(("options", "runs"), [({}, 1), ({"max_parallel_runs": 2}, 2)])
async def test_a_cpu_deployment_runs_as_many_batches_at_once_as_resolved(digits_onnx, options, runs) -> None:
    backend = await _batched(digits_onnx, **options)
    try:
        assert backend.runs_in_flight == runs
        assert backend._batcher.max_in_flight == runs and backend._executor._max_workers == runs
        name = backend.metadata().inputs[0].name
        rows = np.random.default_rng(0).random((8, 64), dtype=np.float32)
        answers = await asyncio.gather(
            *(
                backend.infer(TensorRequest(id=str(i), inputs=[Tensor.from_array(name, rows[i : i + 1])]))
                for i in range(8)
            )
        )
        whole = await backend.infer(TensorRequest(id="all", inputs=[Tensor.from_array(name, rows)]))
        expected = whole.outputs[0].data
        for i, answer in enumerate(answers):
            np.testing.assert_allclose(answer.outputs[0].data, expected[i : i + 1], rtol=1e-5, atol=1e-6)
    finally:
        await backend.close()


@pytest.mark.parametrize(
    ("provider", "device"),
    [
        ("CPUExecutionProvider", "cpu"),
        ("CUDAExecutionProvider", "cuda"),
        ("TensorrtExecutionProvider", "cuda"),
        ("ROCMExecutionProvider", "rocm"),
        ("DmlExecutionProvider", "dml"),
    ],
)
def test_the_first_provider_names_the_device(provider: str, device: str) -> None:
    """One fact decides the device reported, the runs in flight and inline runs (CPU only)."""
    assert device_of(provider) == device
    assert parallel_runs(OnnxOptions(), device == "cpu", 2) == (1 if device == "cpu" else GPU_PARALLEL_RUNS)
