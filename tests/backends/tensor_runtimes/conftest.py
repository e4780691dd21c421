"""Fixtures for the OpenVINO / TF Serving tests: one digits model, written for every runtime.

The weights are trained in a few seconds on scikit-learn's bundled digits data (no download), so
top-1 agreement and accuracy on the test split mean something. The TF Serving test server runs in
a subprocess started once per session (importing TensorFlow takes seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from backends.demo_models.digits import digits_onnx_bytes
from backends.demo_models.exports import write_openvino_ir, write_tf_savedmodel

HIDDEN = 32
REPO = Path(__file__).resolve().parents[3]
SERVER = REPO / "tests" / "tfserving_server.py"
#: the TF Serving test server's subprocess runs TensorFlow on the CPU, quietly
TF_ENV = {"CUDA_VISIBLE_DEVICES": "-1", "TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPP_MIN_LOG_LEVEL": "3"}
# This process only imports TensorFlow's protos (TF Serving adapter): quiet it, but never hide the GPU
# here, or the torch `gpu` tests of the same session would skip on a machine that has one.
for _name in ("TF_ENABLE_ONEDNN_OPTS", "TF_CPP_MIN_LOG_LEVEL"):
    os.environ.setdefault(_name, TF_ENV[_name])


@dataclass(frozen=True)
class Digits:
    x_train: np.ndarray  # [N, 64] float32 in [0, 1]
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@pytest.fixture(scope="session")
def digits() -> Digits:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
    return Digits(x_train, y_train, x_test, y_test)


@pytest.fixture(scope="session")
def weights_npz(digits: Digits, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.neural_network import MLPClassifier

    clf = MLPClassifier(hidden_layer_sizes=(HIDDEN,), max_iter=200, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        clf.fit(digits.x_train, digits.y_train)
    path = tmp_path_factory.mktemp("weights") / "digits.npz"
    np.savez(
        path,
        W1=clf.coefs_[0].astype(np.float32),
        b1=clf.intercepts_[0].astype(np.float32),
        W2=clf.coefs_[1].astype(np.float32),
        b2=clf.intercepts_[1].astype(np.float32),
    )
    return path


def build_digits_onnx(weights_npz: Path, out_path: Path) -> Path:
    """The digits MLP as ONNX, with the same graph `fleetgate demo-models` writes."""
    out_path.write_bytes(digits_onnx_bytes(dict(np.load(weights_npz))))
    return out_path


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def digits_onnx(weights_npz: Path, models_dir: Path) -> Path:
    return build_digits_onnx(weights_npz, models_dir / "digits.onnx")


@pytest.fixture(scope="session")
def digits_ir(digits_onnx: Path, models_dir: Path) -> Path:
    return write_openvino_ir(digits_onnx, models_dir / "ir" / "digits.xml")


@pytest.fixture(scope="session")
def tf_model_base(weights_npz: Path, models_dir: Path) -> Path:
    """TF Serving layout: version 1 is the trained model, version 2 has its output layer negated."""
    base = models_dir / "digits_tf"
    write_tf_savedmodel(weights_npz, base / "1")
    w = dict(np.load(weights_npz))
    w["W2"], w["b2"] = -w["W2"], -w["b2"]
    other = models_dir / "digits_v2.npz"
    np.savez(other, **w)
    write_tf_savedmodel(other, base / "2")
    return base


class TFServingProcess:
    """The test PredictionService server in a subprocess, on a free loopback port."""

    def __init__(self, model_base: Path, *, labels: dict[str, int], port: int = 0) -> None:
        args = [sys.executable, str(SERVER), "--model-name", "digits", "--model-base-path", str(model_base)]
        args += ["--port", str(port)]
        for label, version in labels.items():
            args += ["--label", f"{label}={version}"]
        env = {**os.environ, **TF_ENV}
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True
        )
        self.port = self._wait_listening(timeout_s=90.0)
        self.target = f"127.0.0.1:{self.port}"

    def _wait_listening(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("LISTENING "):
                return int(line.split()[1])
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"TF Serving test server did not start (exit code {self.proc.returncode})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def tfs_server(tf_model_base: Path) -> Iterator[TFServingProcess]:
    server = TFServingProcess(tf_model_base, labels={"stable": 1, "canary": 2})
    yield server
    server.stop()


@pytest.fixture
def tfs_server_factory(tf_model_base: Path) -> Iterator:
    """Start extra servers (for tests that stop one); all are stopped after the test."""
    started: list[TFServingProcess] = []

    def start(port: int = 0) -> TFServingProcess:
        server = TFServingProcess(tf_model_base, labels={"stable": 1}, port=port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
