"""OpenVINO adapter: loading IR and ONNX, f32 results, validation, cache, async queue, errors."""

from __future__ import annotations

import asyncio
import gc
import time
from pathlib import Path

import numpy as np
import pytest
import structlog

from backends import openvino as ov_backend
from backends.base import Capability, Tensor, TensorRequest, as_generative
from backends.errors import BackendError, InvalidInput
from backends.spec import BatchingSpec, DeploymentSpec


def _spec(model: Path, **kw) -> DeploymentSpec:
    return DeploymentSpec(backend="openvino", model=str(model), **kw)


def _request(x: np.ndarray, name: str = "input", rid: str = "r") -> TensorRequest:
    return TensorRequest(id=rid, inputs=[Tensor.from_array(name, x)])


async def _loaded(model: Path, **kw) -> ov_backend.OpenVINOBackend:
    backend = ov_backend.create("digits-ov", _spec(model, **kw))
    await backend.load()
    await backend.warmup()
    return backend


def _ort_reference(onnx_path: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    probs, label = session.run(["probabilities", "label"], {"input": x})
    return {"probabilities": probs, "label": label}


@pytest.mark.parametrize("fmt", ["ir", "onnx"])
async def test_metadata_and_f32_results_match_onnxruntime(fmt, digits, digits_onnx, digits_ir):
    model = digits_ir if fmt == "ir" else digits_onnx
    backend = await _loaded(model)
    try:
        meta = backend.metadata()
        assert meta.platform == ("openvino_ir" if fmt == "ir" else "openvino_onnx")
        assert [(s.name, s.datatype, s.shape) for s in meta.inputs] == [("input", "FP32", (-1, 64))]
        assert {(s.name, s.datatype, s.shape) for s in meta.outputs} == {
            ("probabilities", "FP32", (-1, 10)),
            ("label", "INT64", (-1,)),
        }
        assert meta.device == "CPU"
        assert meta.extra["precision"] == "f32"
        assert meta.extra["performance_hint"] == "LATENCY"
        assert meta.extra["stored_weights"] == "f32"
        assert backend.ready
        x = digits.x_test[:50]
        response = await backend.infer(_request(x))
        got = {t.name: t.data for t in response.outputs}
        ref = _ort_reference(digits_onnx, x)
        assert np.abs(got["probabilities"] - ref["probabilities"]).max() < 1e-5
        assert got["label"].dtype == np.int64
        np.testing.assert_array_equal(got["label"], ref["label"])
    finally:
        await backend.close()
    assert not backend.ready


async def test_any_batch_size_and_requested_outputs(digits, digits_ir):
    backend = await _loaded(digits_ir)
    try:
        for rows in (1, 7, 128):
            response = await backend.infer(
                TensorRequest(
                    id="b", inputs=[Tensor.from_array("input", digits.x_test[:rows])], outputs=["label"]
                )
            )
            assert [t.name for t in response.outputs] == ["label"]
            assert response.outputs[0].shape == (rows,)
    finally:
        await backend.close()


@pytest.mark.parametrize(
    ("x", "name", "fragment"),
    [
        (np.zeros((2, 63), np.float32), "input", "shape"),
        (np.zeros((2, 64), np.float64), "input", "datatype"),
        (np.zeros((2, 64, 1), np.float32), "input", "shape"),
        (np.zeros((2, 64), np.float32), "pixels", "unknown input 'pixels'"),
    ],
)
async def test_bad_input_rejected_before_the_runtime(x, name, fragment, digits_ir, monkeypatch):
    backend = await _loaded(digits_ir)
    try:
        # A spy on the path into the runtime: a rejected request must never reach it.
        started = []
        original = backend._run_async

        async def spy(*args, **kwargs):
            started.append(args)
            return await original(*args, **kwargs)

        monkeypatch.setattr(backend, "_run_async", spy)
        with pytest.raises(InvalidInput) as info:
            await backend.infer(_request(x, name))
        assert info.value.status == 400
        assert fragment in info.value.message
        assert started == []
    finally:
        await backend.close()


async def test_unknown_output_rejected(digits_ir):
    backend = await _loaded(digits_ir)
    try:
        request = TensorRequest(
            id="o", inputs=[Tensor.from_array("input", np.zeros((1, 64), np.float32))], outputs=["x"]
        )
        with pytest.raises(InvalidInput, match="unknown output"):
            await backend.infer(request)
    finally:
        await backend.close()


async def test_corrupt_model_fails_load_with_one_line_message(digits_ir, tmp_path):
    xml = tmp_path / "broken.xml"
    xml.write_text("<net name='x'><layers><layer id='0'")  # truncated XML
    (tmp_path / "broken.bin").write_bytes(b"\0" * 16)
    backend = ov_backend.create("broken", _spec(xml))
    with pytest.raises(RuntimeError) as info:
        await backend.load()
    message = str(info.value)
    assert message.startswith(f"cannot read OpenVINO model {xml}")
    assert "\n" not in message
    assert not backend.ready

    onnx_file = tmp_path / "garbage.onnx"
    onnx_file.write_bytes(b"this is not a protobuf" * 10)
    backend = ov_backend.create("garbage", _spec(onnx_file))
    with pytest.raises(RuntimeError, match="cannot read OpenVINO model") as info:
        await backend.load()
    assert "\n" not in str(info.value)


def test_create_validates_fields_and_options(digits_ir, tmp_path):
    with pytest.raises(ValueError, match="options.*performance_hint"):
        ov_backend.create("x", _spec(digits_ir, options={"performance_hint": "FAST"}))
    with pytest.raises(ValueError, match="unknown field `turbo`"):
        ov_backend.create("x", _spec(digits_ir, options={"turbo": True}))
    with pytest.raises(ValueError, match="num_requests"):
        ov_backend.create("x", _spec(digits_ir, options={"num_requests": 0}))
    with pytest.raises(ValueError, match="is not a file"):
        ov_backend.create("x", _spec(tmp_path / "missing.xml"))
    lonely = tmp_path / "lonely.xml"
    lonely.write_text("<net/>")
    with pytest.raises(ValueError, match=r"lonely\.bin"):
        ov_backend.create("x", _spec(lonely))
    with pytest.raises(ValueError, match="model"):
        ov_backend.create("x", DeploymentSpec(backend="openvino"))


async def test_compiled_model_cache_is_populated_and_reused(digits, digits_ir, tmp_path):
    cache = tmp_path / "ov-cache"
    backend = await _loaded(digits_ir, options={"cache_dir": str(cache)})
    first = (await backend.infer(_request(digits.x_test[:5]))).outputs
    await backend.close()
    blobs = [p for p in cache.rglob("*") if p.is_file()]
    assert blobs, "the compiled-model cache folder stayed empty"
    mtimes = {p: p.stat().st_mtime_ns for p in blobs}
    again = await _loaded(digits_ir, options={"cache_dir": str(cache)})  # imports the blob
    try:
        second = (await again.infer(_request(digits.x_test[:5]))).outputs
        np.testing.assert_array_equal(first[0].data, second[0].data)
        assert {p: p.stat().st_mtime_ns for p in blobs} == mtimes  # reused, not rewritten
        assert again.metadata().extra["cache_dir"] == str(cache)
    finally:
        await again.close()


async def test_throughput_hint_sizes_queue_from_device(digits_ir):
    backend = await _loaded(digits_ir, options={"performance_hint": "THROUGHPUT"})
    try:
        optimal = backend._compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")
        assert backend.num_requests == optimal >= 1
        assert backend.metadata().extra["performance_hint"] == "THROUGHPUT"
    finally:
        await backend.close()
    fixed = await _loaded(digits_ir, options={"num_requests": 3})
    try:
        assert fixed.num_requests == 3
    finally:
        await fixed.close()


async def test_event_loop_not_blocked_while_openvino_infers(digits, digits_ir):
    """64 concurrent large requests on 2 infer requests; a 5 ms ticker must keep ticking."""
    backend = await _loaded(digits_ir, options={"num_requests": 2})
    x = np.repeat(digits.x_test[:1], 60000, axis=0)  # ~4 ms of work per request on a quiet machine

    async def longest_stall() -> tuple[float, float]:
        """The ticker's longest gap while the 64 requests ran, and how long they ran."""
        ticks: list[float] = []
        stop = asyncio.Event()

        async def ticker() -> None:
            while not stop.is_set():
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.005)

        task = asyncio.create_task(ticker())
        start = time.perf_counter()
        results = await asyncio.gather(*(backend.infer(_request(x, rid=str(i))) for i in range(64)))
        elapsed = time.perf_counter() - start
        stop.set()
        await task
        assert len(results) == 64
        assert all(r.outputs[0].shape[0] == 60000 for r in results)
        assert elapsed > 0.1
        assert len(ticks) >= elapsed / 0.05
        return float(np.diff(ticks).max()), elapsed

    # What is measured is the backend's hold on the loop, not the collector's: a full collection of
    # the suite's heap (torch, TensorFlow, transformers imported by earlier tests) can pause the loop
    # for a second (CI saw a 1.1 s gap that no run of these tests alone shows), so the heap is frozen
    # out of collections; a second try forgives one stall of the shared host itself. A backend that
    # blocks the loop fails both.
    gc.collect()
    gc.freeze()
    try:
        # Inference took a while; the loop still ran the ticker all along (no gap near the total).
        gap, elapsed = await longest_stall()
        if gap >= max(0.1, elapsed / 4):
            gap, elapsed = await longest_stall()
        assert gap < max(0.1, elapsed / 4)
    finally:
        gc.unfreeze()
        await backend.close()


@pytest.mark.parametrize("device", ["AUTO", "HETERO:CPU"])
async def test_virtual_devices_report_the_real_one(device, digits, digits_onnx, digits_ir):
    backend = await _loaded(digits_ir, device=device)
    try:
        meta = backend.metadata()
        assert meta.extra["requested_device"] == device
        assert meta.device == "CPU"
        got = {t.name: t.data for t in (await backend.infer(_request(digits.x_test[:20]))).outputs}
        ref = _ort_reference(digits_onnx, digits.x_test[:20])
        assert np.abs(got["probabilities"] - ref["probabilities"]).max() < 1e-5
    finally:
        await backend.close()


async def test_lower_precision_is_explicit(digits_ir):
    """bf16 where the CPU has it; where it has not, OpenVINO compiles f32, and the gateway says so."""
    import openvino as ov

    has_bf16 = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    with structlog.testing.capture_logs() as logs:
        low = await _loaded(digits_ir, options={"precision": "bf16"})
    try:
        assert low.metadata().extra["precision"] == ("bf16" if has_bf16 else "f32")
        warned = [e for e in logs if e["event"] == "openvino_precision_unavailable"]
        if has_bf16:
            assert not warned
        else:
            assert warned and warned[0]["requested"] == "bf16" and warned[0]["running"] == "f32"
    finally:
        await low.close()


async def test_an_ir_with_f16_weights_is_reported(digits, digits_onnx, tmp_path, capsys):
    """`ov.save_model` compresses weights to f16 by default: the gateway says so rather than serving
    silently different numbers from the f32 source."""
    import openvino as ov

    compressed = tmp_path / "digits-f16.xml"
    ov.save_model(ov.convert_model(str(digits_onnx)), str(compressed))  # compress_to_fp16 by default
    backend = await _loaded(compressed)
    try:
        assert backend.metadata().extra["stored_weights"] == "f16"
        assert "compress_to_fp16=False" in capsys.readouterr().out
        got = (await backend.infer(_request(digits.x_test[:50]))).outputs
        probs = next(t.data for t in got if t.name == "probabilities")
        gap = np.abs(probs - _ort_reference(digits_onnx, digits.x_test[:50])["probabilities"]).max()
        assert 1e-7 < gap < 1e-2  # f16 weights: a real but small difference (an f32 IR stays < 1e-5)
    finally:
        await backend.close()


async def test_batched_deployment_merges_concurrent_requests(digits, digits_onnx, digits_ir):
    backend = await _loaded(digits_ir, batching=BatchingSpec(max_batch_size=32, max_delay_ms=5))
    batches: list[tuple[int, int]] = []
    backend.batch_observer = lambda n, rows: batches.append((n, rows))
    try:
        x = digits.x_test[:24]
        responses = await asyncio.gather(
            *(backend.infer(_request(x[i : i + 1], rid=str(i))) for i in range(24))
        )
        probs = np.concatenate([{t.name: t.data for t in r.outputs}["probabilities"] for r in responses])
        ref = _ort_reference(digits_onnx, x)
        assert np.abs(probs - ref["probabilities"]).max() < 1e-5
        assert max(n for n, _ in batches) > 1, batches
    finally:
        await backend.close()


async def test_generate_is_refused(digits_ir):
    """Text generation is not declared, so the gateway refuses it before the backend (400)."""
    backend = ov_backend.create("x", _spec(digits_ir))
    assert backend.capabilities == frozenset({Capability.TENSOR})
    with pytest.raises(TypeError, match="does not generate text"):
        as_generative(backend)


async def test_requests_are_served_in_arrival_order(digits, digits_ir):
    """One infer request, 24 callers: a freed request goes to the longest waiter, never a newcomer."""
    backend = await _loaded(digits_ir, options={"num_requests": 1})
    done: list[int] = []
    x = np.repeat(digits.x_test[:1], 2000, axis=0)

    async def call(i: int) -> None:
        await backend.infer(_request(x, rid=str(i)))
        done.append(i)

    try:
        await asyncio.gather(*(call(i) for i in range(24)))
        assert done == list(range(24))
    finally:
        await backend.close()


async def test_timed_out_callers_do_not_leak_infer_requests(digits, digits_ir):
    backend = await _loaded(digits_ir, options={"num_requests": 2})
    backend.spec = _spec(digits_ir, options={"num_requests": 2}, timeout_s=0.002)
    x = np.repeat(digits.x_test[:1], 20000, axis=0)
    try:
        outcomes = await asyncio.gather(
            *(backend.infer(_request(x)) for _ in range(16)), return_exceptions=True
        )
        timeouts = [o for o in outcomes if isinstance(o, BackendError)]
        assert timeouts and all(o.status == 504 for o in timeouts)
        for _ in range(200):  # the started requests finish on OpenVINO's threads
            if backend._slots.free == 2:
                break
            await asyncio.sleep(0.01)
        assert backend._slots.free == 2
        backend.spec = _spec(digits_ir, timeout_s=10.0)
        results = await asyncio.gather(*(backend.infer(_request(digits.x_test[:3])) for _ in range(8)))
        assert len(results) == 8
    finally:
        await backend.close()
