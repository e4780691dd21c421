"""`fleetgate demo-models`: build real, small models locally, in seconds, with no downloads.

The digits model is an MLP trained on scikit-learn's bundled 8x8 digits data set:
`input` FP32 [-1, 64] (raw pixel values 0..16) -> dense(64->32) relu -> dense(32->10) -> softmax,
with outputs `probabilities` FP32 [-1, 10] and `label` INT64 [-1]. The 1/16 input scaling is folded
into the first layer's weights, so every runtime computes exactly the same function. It is written
as ONNX, as OpenVINO IR and as a TF SavedModel, plus a tiny random-weight Llama for the LLM engine.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import structlog

from backends.runtime.lazy import require

log = structlog.get_logger(__name__)

HIDDEN = 32
SEED = 0


class DigitsModel(msgspec.Struct):
    onnx_path: Path
    weights_path: Path
    #: top-1 accuracy on the held-out test split (25% of the data set)
    test_accuracy: float


def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, x_test, y_train, y_test) of scikit-learn's digits, raw pixels as float32."""
    datasets = require("sklearn.datasets", extra="demo")
    model_selection = require("sklearn.model_selection", extra="demo")
    x, y = datasets.load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        x.astype(np.float32), y, test_size=0.25, random_state=SEED, stratify=y
    )
    return x_train, x_test, y_train, y_test


def train_digits() -> tuple[dict[str, np.ndarray], float]:
    """Train the MLP; returns its weights (scaling folded in) and its test accuracy."""
    neural = require("sklearn.neural_network", extra="demo")
    x_train, x_test, y_train, y_test = digits_split()
    clf = neural.MLPClassifier(hidden_layer_sizes=(HIDDEN,), max_iter=400, random_state=SEED)
    clf.fit(x_train / 16.0, y_train)
    accuracy = float(clf.score(x_test / 16.0, y_test))
    weights = {
        "W1": (clf.coefs_[0] / 16.0).astype(np.float32),
        "b1": clf.intercepts_[0].astype(np.float32),
        "W2": clf.coefs_[1].astype(np.float32),
        "b2": clf.intercepts_[1].astype(np.float32),
    }
    return weights, accuracy


def digits_onnx_bytes(weights: dict[str, np.ndarray]) -> bytes:
    """The MLP as an ONNX graph (opset 17, IR 8, readable by every ONNX Runtime since 1.14)."""
    onnx = require("onnx", extra="demo")
    h, tp = onnx.helper, onnx.TensorProto
    nodes = [
        h.make_node("MatMul", ["input", "W1"], ["z1"]),
        h.make_node("Add", ["z1", "b1"], ["a1"]),
        h.make_node("Relu", ["a1"], ["h1"]),
        h.make_node("MatMul", ["h1", "W2"], ["z2"]),
        h.make_node("Add", ["z2", "b2"], ["logits"]),
        h.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
        h.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0),
    ]
    graph = h.make_graph(
        nodes,
        "digits_mlp",
        [h.make_tensor_value_info("input", tp.FLOAT, ["batch", 64])],
        [
            h.make_tensor_value_info("probabilities", tp.FLOAT, ["batch", 10]),
            h.make_tensor_value_info("label", tp.INT64, ["batch"]),
        ],
        initializer=[onnx.numpy_helper.from_array(v, name=k) for k, v in weights.items()],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)], producer_name="fleetgate")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def write_digits(out_dir: Path) -> DigitsModel:
    """Train and write `digits.onnx` and `digits_weights.npz` under `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights, accuracy = train_digits()
    weights_path = out_dir / "digits_weights.npz"
    np.savez(weights_path, **weights)
    onnx_path = out_dir / "digits.onnx"
    onnx_path.write_bytes(digits_onnx_bytes(weights))
    return DigitsModel(onnx_path=onnx_path, weights_path=weights_path, test_accuracy=accuracy)


def write_all(out_dir: Path, *, savedmodel: bool = True, llama: bool = True) -> dict[str, str]:
    """Write every demo model; returns name -> path of what was written.

    The OpenVINO IR, the SavedModel and the Llama need their runtimes' extras; a missing one is
    skipped with a log line rather than failing the whole command.
    """
    from backends.runtime.lazy import MissingRuntime

    written: dict[str, str] = {}
    digits = write_digits(out_dir)
    written["digits.onnx"] = str(digits.onnx_path)
    log.info("demo_model_written", model="digits.onnx", test_accuracy=round(digits.test_accuracy, 4))
    try:
        from backends.demo_models.exports import write_openvino_ir, write_tf_savedmodel

        written["digits.xml"] = str(write_openvino_ir(digits.onnx_path, out_dir / "digits.xml"))
        if savedmodel:
            written["digits_savedmodel"] = str(
                write_tf_savedmodel(digits.weights_path, out_dir / "digits_savedmodel")
            )
    except (ImportError, MissingRuntime) as exc:
        log.warning("demo_model_skipped", reason=str(exc))
    if llama:
        try:
            from backends.demo_models.tiny_llama import write_tiny_llama

            written["tiny-llama"] = str(write_tiny_llama(out_dir / "tiny-llama"))
        except (ImportError, MissingRuntime) as exc:
            log.warning("demo_model_skipped", model="tiny-llama", reason=str(exc))
    written["digits_test_accuracy"] = f"{digits.test_accuracy:.4f}"
    return written
