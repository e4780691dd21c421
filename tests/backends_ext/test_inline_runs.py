"""Runtime calls on the event loop's thread for small, fast models (`backends/inline_runs.py`), and
the ONNX Runtime backend that uses it, on the real digits model."""

from __future__ import annotations

import numpy as np
import pytest

from backends.base import Tensor, TensorRequest
from backends.errors import BackendError
from backends.inline_runs import InlineRuns
from backends.registry import create_backend
from backends.spec import DeploymentSpec


def _measured(runs: InlineRuns, *seconds: float) -> InlineRuns:
    runs.record(1.0)  # the first inline run pays lazy initialisation: not counted
    for s in seconds:
        runs.record(s)
    return runs


def test_calls_run_inline_until_measured_and_fast_runs_stay_inline() -> None:
    runs = InlineRuns(below_s=200e-6)
    assert runs.run_inline(1024) and runs.run_inline(1024)  # nothing measured yet: measure inline
    runs.record(5e-3)  # the first run (lazy initialisation) is not counted
    assert runs.estimate_s is None and runs.run_inline(1024)
    runs.record(20e-6)
    assert all(runs.run_inline(1024) for _ in range(10))
    assert runs.inline_calls == 13 and runs.worker_calls == 0


def test_one_stretched_run_does_not_move_the_estimate() -> None:
    runs = _measured(InlineRuns(below_s=200e-6), 15e-6, 16e-6, 50e-3, 14e-6)  # one run preempted
    assert runs.estimate_s == pytest.approx(15.5e-6) and runs.run_inline(100)


def test_large_inputs_always_go_to_a_worker() -> None:
    runs = _measured(InlineRuns(below_s=200e-6, max_bytes=4096), 10e-6)
    assert not runs.run_inline(4097)
    assert runs.run_inline(4096)


def test_a_model_near_the_bound_is_probed_again_now_and_then() -> None:
    runs = _measured(InlineRuns(below_s=100e-6, probe_every=8), 300e-6)  # slower, within 4x
    decisions = [runs.run_inline(100) for _ in range(24)]
    assert decisions.count(True) == 3 and decisions[7] and decisions[15] and decisions[23]
    runs.record(10e-6)
    runs.record(12e-6)  # probes saw it fast: the median of the window follows
    assert runs.estimate_s == pytest.approx(12e-6) and runs.run_inline(100)


def test_a_model_far_slower_than_the_bound_never_runs_inline_again() -> None:
    runs = _measured(InlineRuns(below_s=100e-6, probe_every=2), 5e-3)
    assert not any(runs.run_inline(100) for _ in range(100))


def test_zero_turns_it_off() -> None:
    runs = InlineRuns(below_s=0)
    assert not runs.run_inline(1)
    assert runs.worker_calls == 1


async def _loaded(digits_path: str, **options: object):  # noqa: ANN202
    backend = create_backend(
        "inline", DeploymentSpec(backend="onnxruntime", model=digits_path, options=options)
    )
    await backend.load()
    await backend.warmup()
    return backend


def _request(backend, rows: np.ndarray) -> TensorRequest:  # noqa: ANN001
    name = backend.metadata().inputs[0].name
    return TensorRequest(id="r", inputs=[Tensor.from_array(name, rows.astype(np.float32))])


async def test_onnxruntime_runs_the_digits_model_inline_with_the_same_answers(digits_onnx) -> None:
    import onnxruntime as ort

    rows = np.random.default_rng(0).uniform(0, 16, (3, 64)).astype(np.float32)
    direct = ort.InferenceSession(str(digits_onnx), providers=["CPUExecutionProvider"])
    expected = direct.run(None, {direct.get_inputs()[0].name: rows})
    inline = await _loaded(str(digits_onnx))
    worker = await _loaded(str(digits_onnx), inline_below_us=0)
    try:
        assert inline.inline.estimate_s is None  # the warm-up ran inline, its time not counted
        for backend in (inline, worker):
            response = await backend.infer(_request(backend, rows))
            got = {t.name: t.data for t in response.outputs}
            for output, want in zip(direct.get_outputs(), expected, strict=True):
                np.testing.assert_allclose(got[output.name], want, rtol=1e-6)
        assert inline.inline.inline_calls == 2 and inline.inline.worker_calls == 0
        assert worker.inline.inline_calls == 0 and worker.inline.worker_calls == 2
    finally:
        await inline.close()
        await worker.close()


async def test_a_request_over_the_size_bound_runs_on_a_worker(digits_onnx) -> None:
    backend = await _loaded(str(digits_onnx))
    try:
        many_rows = np.zeros((300, 64), np.float32)  # 76.8 kB, over the 64 KiB bound
        await backend.infer(_request(backend, many_rows))
        assert backend.inline.worker_calls == 1
    finally:
        await backend.close()


async def test_bad_input_inline_is_a_400_and_the_backend_still_serves(digits_onnx) -> None:
    backend = await _loaded(str(digits_onnx))
    try:
        with pytest.raises(BackendError) as failed:
            await backend._run_async(
                {backend.metadata().inputs[0].name: np.zeros((1, 63), np.float32)}, None
            )  # wrong width
        assert failed.value.status == 400
        assert backend.inline.inline_calls == 2  # the warm-up, then the bad call, both inline
        response = await backend.infer(_request(backend, np.ones((1, 64))))
        assert response.outputs
    finally:
        await backend.close()


async def test_a_model_measured_slower_than_the_bound_runs_on_workers(digits_onnx) -> None:
    backend = await _loaded(str(digits_onnx), inline_below_us=1)  # ~15 us a run: over 4x of 1 us
    try:
        for _ in range(5):
            await backend.infer(_request(backend, np.ones((1, 64))))
        # the warm-up and the first call inline (the warm-up's time is not counted), then workers
        assert backend.inline.inline_calls == 2 and backend.inline.worker_calls == 4
    finally:
        await backend.close()


def test_a_negative_bound_is_refused(digits_onnx) -> None:
    with pytest.raises(ValueError, match="inline_below_us"):
        create_backend(
            "inline",
            DeploymentSpec(backend="onnxruntime", model=str(digits_onnx), options={"inline_below_us": -1}),
        )


async def _openvino(digits_ir, **options: object):  # noqa: ANN001, ANN202
    backend = create_backend(
        "inline-ov", DeploymentSpec(backend="openvino", model=str(digits_ir), options=options)
    )
    await backend.load()
    await backend.warmup()
    return backend


async def test_openvino_runs_small_calls_inline_with_the_queue_s_answers(digits, digits_ir) -> None:
    inline = await _openvino(digits_ir)
    queued = await _openvino(digits_ir, inline_below_us=0)
    try:
        rows = digits.x_test[:5]
        answers = []
        for backend in (inline, queued):
            response = await backend.infer(_request(backend, rows))
            answers.append({t.name: t.data for t in response.outputs})
        assert answers[0].keys() == answers[1].keys()
        for name in answers[0]:
            np.testing.assert_array_equal(answers[0][name], answers[1][name])
        assert inline.inline.inline_calls == 2 and inline.inline.worker_calls == 0
        assert queued.inline.inline_calls == 0 and queued.inline.worker_calls == 2
        big = np.repeat(digits.x_test[:1], 300, axis=0)  # 76.8 kB: the queue
        await inline.infer(_request(inline, big))
        assert inline.inline.worker_calls == 1
    finally:
        await inline.close()
        await queued.close()
    with pytest.raises(BackendError, match="not loaded"):
        await inline._run_async({"input": digits.x_test[:1]}, None)


def test_openvino_refuses_a_negative_bound(digits_ir) -> None:
    with pytest.raises(ValueError, match="inline_below_us"):
        create_backend(
            "inline-ov",
            DeploymentSpec(backend="openvino", model=str(digits_ir), options={"inline_below_us": -5}),
        )
