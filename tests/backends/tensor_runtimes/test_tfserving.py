"""TF Serving adapter against the PredictionService test server (real gRPC, real SavedModel)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from backends import tfserving
from backends.base import Tensor, TensorRequest
from backends.errors import BackendTimeout, BackendUnavailable, InvalidInput, ModelNotFound
from backends.spec import DeploymentSpec


def _spec(target: str, **kw) -> DeploymentSpec:
    kw.setdefault("model_name", "digits")
    kw.setdefault("timeout_s", 10.0)
    return DeploymentSpec(backend="tfserving", target=target, **kw)


def _request(x: np.ndarray, name: str = "input", outputs: list[str] | None = None) -> TensorRequest:
    return TensorRequest(id="t", inputs=[Tensor.from_array(name, x)], outputs=outputs)


async def _loaded(target: str, **kw) -> tfserving.TFServingBackend:
    backend = tfserving.create("digits-tfs", _spec(target, **kw))
    await backend.load()
    await backend.warmup()
    return backend


def _outputs(response) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    return {t.name: t.data for t in response.outputs}


async def test_metadata_from_signature_def(tfs_server):
    backend = await _loaded(tfs_server.target)
    try:
        meta = backend.metadata()
        assert backend.ready
        assert meta.platform == "tensorflow_savedmodel"
        assert [(s.name, s.datatype, s.shape) for s in meta.inputs] == [("input", "FP32", (-1, 64))]
        assert [(s.name, s.datatype, s.shape) for s in meta.outputs] == [
            ("label", "INT64", (-1,)),
            ("probabilities", "FP32", (-1, 10)),
        ]
        assert meta.versions == ["2"]  # no version asked: the server's latest
        assert meta.extra["signature_name"] == "serving_default"
    finally:
        await backend.close()
    assert not backend.ready


async def test_versions_and_labels_select_the_servable(tfs_server, digits):
    x = digits.x_test[:40]
    v1 = await _loaded(tfs_server.target, options={"version": 1})
    stable = await _loaded(tfs_server.target, options={"version_label": "stable"})
    canary = await _loaded(tfs_server.target, options={"version_label": "canary"})
    try:
        assert v1.metadata().versions == ["1"]
        assert canary.metadata().versions == ["2"]
        out1 = _outputs(await v1.infer(_request(x)))
        out_stable = _outputs(await stable.infer(_request(x)))
        out_canary = _outputs(await canary.infer(_request(x)))
        np.testing.assert_array_equal(out1["probabilities"], out_stable["probabilities"])
        # version 2 negates the output layer: a different servable answered
        assert (out1["label"] != out_canary["label"]).mean() > 0.5
    finally:
        for b in (v1, stable, canary):
            await b.close()


@pytest.mark.parametrize(
    ("options", "model_name", "fragment"),
    [
        ({"version": 7}, "digits", "Specific(digits, 7)"),
        ({"version_label": "nightly"}, "digits", "nightly"),
        ({}, "mnist", "mnist"),
    ],
)
async def test_unknown_model_version_or_label_is_404(tfs_server, options, model_name, fragment):
    backend = tfserving.create("x", _spec(tfs_server.target, model_name=model_name, options=options))
    with pytest.raises(ModelNotFound) as info:
        await backend.load()
    assert info.value.status == 404
    assert fragment in info.value.message
    await backend.close()


async def test_unknown_signature_fails_load(tfs_server):
    backend = tfserving.create("x", _spec(tfs_server.target, options={"signature_name": "classify"}))
    with pytest.raises(RuntimeError, match="no signature 'classify'"):
        await backend.load()
    await backend.close()


@pytest.mark.parametrize(
    ("x", "name", "fragment"),
    [
        (np.zeros((3, 8, 8), np.float32), "input", "shape"),
        (np.zeros((3, 64), np.int32), "input", "datatype"),
        (np.zeros((3, 64), np.float32), "image", "unknown input 'image'"),
    ],
)
async def test_bad_input_rejected_before_the_server(tfs_server, monkeypatch, x, name, fragment):
    backend = await _loaded(tfs_server.target)
    calls: list[str] = []
    original = backend._call

    async def spy(method, request):  # type: ignore[no-untyped-def]
        calls.append(method)
        return await original(method, request)

    monkeypatch.setattr(backend, "_call", spy)
    try:
        with pytest.raises(InvalidInput) as info:
            await backend.infer(_request(x, name))
        assert info.value.status == 400
        assert fragment in info.value.message
        assert calls == []
    finally:
        await backend.close()


async def test_server_invalid_argument_maps_to_400(tfs_server):
    """Skip the gateway's own check: the server's INVALID_ARGUMENT must still become a 400."""
    backend = await _loaded(tfs_server.target)
    try:
        with pytest.raises(InvalidInput) as info:
            await backend._run_async({"input": np.zeros((2, 63), np.float32)}, None)
        assert info.value.status == 400
        assert "INVALID_ARGUMENT" in info.value.message
    finally:
        await backend.close()


async def test_requested_outputs_only(tfs_server, digits):
    backend = await _loaded(tfs_server.target)
    try:
        response = await backend.infer(_request(digits.x_test[:5], outputs=["label"]))
        assert [t.name for t in response.outputs] == ["label"]
        assert response.outputs[0].data.dtype == np.int64
        with pytest.raises(InvalidInput, match="unknown output"):
            await backend.infer(_request(digits.x_test[:5], outputs=["logits"]))
    finally:
        await backend.close()


async def test_deadline_exceeded_is_504(tfs_server, digits):
    backend = await _loaded(tfs_server.target)
    try:
        backend.spec = _spec(tfs_server.target, timeout_s=1e-5)
        with pytest.raises(BackendTimeout) as info:
            await backend.infer(_request(np.repeat(digits.x_test[:1], 2000, axis=0)))
        assert info.value.status == 504
    finally:
        await backend.close()


async def test_server_stopped_mid_run_is_503_and_recovers(tfs_server_factory, digits):
    server = tfs_server_factory()
    backend = await _loaded(server.target, options={"channels": 2})
    try:
        x = digits.x_test[:8]
        before = _outputs(await backend.infer(_request(x)))
        assert backend.ready
        server.stop()
        for _ in range(2):  # both pooled channels report the outage
            with pytest.raises(BackendUnavailable) as info:
                await backend.infer(_request(x))
            assert info.value.status == 503
        assert not backend.ready

        # The same port comes back: readiness returns without reloading the deployment.
        revived = tfs_server_factory(port=server.port)
        deadline = time.monotonic() + 20
        while not backend.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert backend.ready
        after = _outputs(await backend.infer(_request(x)))
        np.testing.assert_array_equal(before["probabilities"], after["probabilities"])
        revived.stop()
    finally:
        await backend.close()


async def test_server_down_at_load_is_503_until_it_starts(tfs_server_factory, digits):
    import socket

    with socket.socket() as s:  # a port nobody listens on yet
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = tfserving.create("x", _spec(f"127.0.0.1:{port}", timeout_s=2.0))
    try:
        await backend.load()  # does not fail: the router falls back while the server is down
        await backend.warmup()
        assert not backend.ready
        with pytest.raises(BackendUnavailable) as info:
            await backend.infer(_request(digits.x_test[:2]))
        assert info.value.status == 503
        tfs_server_factory(port=port)
        deadline = time.monotonic() + 30
        while not backend.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert backend.ready
        assert backend.metadata().versions == ["2"]
        response = await backend.infer(_request(digits.x_test[:2]))
        assert response.outputs[0].shape[0] == 2
    finally:
        await backend.close()


def test_create_validates_fields_and_options():
    with pytest.raises(ValueError, match="target"):
        tfserving.create("x", DeploymentSpec(backend="tfserving", model_name="digits"))
    with pytest.raises(ValueError, match="host:port"):
        tfserving.create("x", _spec("localhost"))
    with pytest.raises(ValueError, match="not both"):
        tfserving.create("x", _spec("h:1", options={"version": 1, "version_label": "a"}))
    with pytest.raises(ValueError, match="unknown field `verison`"):
        tfserving.create("x", _spec("h:1", options={"verison": 1}))
    with pytest.raises(ValueError, match=r"options\.channels"):
        tfserving.create("x", _spec("h:1", options={"channels": "two"}))
    assert tfserving.create("digits", _spec("h:8500", model_name=None)).model_name == "digits"
