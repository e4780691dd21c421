"""The TF Serving adapter against a real `tensorflow_model_server`, when one is on PATH.

No such binary can be installed on the project's machines (it is not in any reachable registry),
so this group is skipped there; on a machine with TF Serving it checks the same behaviour as the
test server: metadata, versions, labels, parity with ONNX Runtime and status codes.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from backends import tfserving
from backends.base import Tensor, TensorRequest
from backends.errors import InvalidInput, ModelNotFound
from backends.spec import DeploymentSpec
from tests.servers import free_port

BINARY = shutil.which("tensorflow_model_server")
pytestmark = pytest.mark.skipif(
    BINARY is None, reason="no tensorflow_model_server on PATH: real TF Serving tests need the binary"
)


@pytest.fixture(scope="module")
def real_server(tf_model_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    config = tmp_path_factory.mktemp("tfs") / "models.config"
    labels = "version_labels { key: 'stable' value: 1 } version_labels { key: 'canary' value: 2 }"
    body = f"name: 'digits' base_path: '{tf_model_base}' model_platform: 'tensorflow'"
    config.write_text(
        "model_config_list { config { " + body + " model_version_policy { all {} } " + labels + " } }"
    )
    port = free_port()
    proc = subprocess.Popen(
        [
            str(BINARY),
            f"--port={port}",
            f"--model_config_file={config}",
            "--allow_version_labels_for_unavailable_models",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    target = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    time.sleep(2.0)  # the port opens before every version has loaded
    yield target
    proc.terminate()
    proc.wait(timeout=10)


async def _load(target: str, **options) -> tfserving.TFServingBackend:
    spec = DeploymentSpec(backend="tfserving", target=target, model_name="digits", options=options)
    backend = tfserving.create("digits-real", spec)
    await backend.load()
    return backend


async def test_real_server_parity_with_onnxruntime(real_server, digits, digits_onnx):
    import onnxruntime as ort

    session = ort.InferenceSession(str(digits_onnx), providers=["CPUExecutionProvider"])
    ref_probs, ref_label = session.run(["probabilities", "label"], {"input": digits.x_test})
    backend = await _load(real_server, version_label="stable")
    try:
        assert backend.metadata().versions == ["1"]
        response = await backend.infer(
            TensorRequest(id="r", inputs=[Tensor.from_array("input", digits.x_test)])
        )
        out = {t.name: t.data for t in response.outputs}
        assert np.abs(out["probabilities"] - ref_probs).max() < 1e-4
        np.testing.assert_array_equal(out["label"], ref_label)
        with pytest.raises(InvalidInput):
            await backend._run_async({"input": np.zeros((2, 63), np.float32)}, None)
    finally:
        await backend.close()


async def test_real_server_unknown_version_is_404(real_server):
    backend = tfserving.create(
        "x",
        DeploymentSpec(backend="tfserving", target=real_server, model_name="digits", options={"version": 9}),
    )
    with pytest.raises(ModelNotFound):
        await backend.load()
    await backend.close()
