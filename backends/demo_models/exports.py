"""Write the demo digits model for runtimes other than ONNX Runtime.

The digits model is an MLP: `input` FP32 [-1, 64] -> dense(64->H) -> relu -> dense(H->10) ->
softmax -> `probabilities` FP32 [-1, 10] and `label` INT64 [-1] (argmax). Its weights travel as an
npz with `W1` [64, H], `b1` [H], `W2` [H, 10], `b2` [10] (float32).

OpenVINO and TensorFlow are imported inside the functions: writing one format must not require
the other runtime, and importing this module must stay cheap.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DIGITS_FEATURES = 64
DIGITS_CLASSES = 10


def load_digits_weights(weights_npz: Path) -> dict[str, np.ndarray]:
    """Read and check the digits weights.

    Raises:
        ValueError: an array is missing or has the wrong shape.
    """
    with np.load(weights_npz) as data:
        weights = {k: np.asarray(data[k], dtype=np.float32) for k in ("W1", "b1", "W2", "b2") if k in data}
    missing = sorted({"W1", "b1", "W2", "b2"} - set(weights))
    if missing:
        raise ValueError(f"{weights_npz}: missing array(s) {missing}")
    hidden = weights["W1"].shape[1] if weights["W1"].ndim == 2 else -1
    expected = {
        "W1": (DIGITS_FEATURES, hidden),
        "b1": (hidden,),
        "W2": (hidden, DIGITS_CLASSES),
        "b2": (DIGITS_CLASSES,),
    }
    for key, shape in expected.items():
        if weights[key].shape != shape or hidden < 1:
            raise ValueError(f"{weights_npz}: {key} has shape {weights[key].shape}, expected {shape}")
    return weights


def write_openvino_ir(onnx_path: Path, out_xml: Path) -> Path:
    """Convert an ONNX model to OpenVINO IR (`out_xml` plus its `.bin`), keeping f32 weights.

    `ov.save_model` compresses weights to f16 by default; that would change results, so it is off.

    Returns:
        The path of the written `.xml`.
    """
    import openvino as ov

    out_xml = Path(out_xml)
    if out_xml.suffix != ".xml":
        raise ValueError(f"{out_xml}: an OpenVINO IR file name must end in .xml")
    out_xml.parent.mkdir(parents=True, exist_ok=True)
    model = ov.convert_model(str(onnx_path))
    ov.save_model(model, str(out_xml), compress_to_fp16=False)
    return out_xml


def write_tf_savedmodel(weights_npz: Path, out_dir: Path) -> Path:
    """Write the digits MLP as a TensorFlow SavedModel with a `serving_default` signature.

    TF Serving expects `<model_base_path>/<version>/saved_model.pb`: pass `.../digits/1` as
    `out_dir` for version 1.

    Returns:
        `out_dir`.
    """
    import tensorflow as tf

    weights = load_digits_weights(Path(weights_npz))
    module = _digits_module(tf, weights)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    signature = module.serve.get_concrete_function(
        tf.TensorSpec([None, DIGITS_FEATURES], tf.float32, name="input")
    )
    tf.saved_model.save(module, str(out_dir), signatures={"serving_default": signature})
    return out_dir


def _digits_module(tf, weights: dict[str, np.ndarray]):  # type: ignore[no-untyped-def]
    """A tf.Module computing the same math as the ONNX graph (f32 throughout)."""

    class DigitsMLP(tf.Module):
        def __init__(self) -> None:
            super().__init__(name="digits_mlp")
            self.w1 = tf.Variable(weights["W1"], trainable=False, name="W1")
            self.b1 = tf.Variable(weights["b1"], trainable=False, name="b1")
            self.w2 = tf.Variable(weights["W2"], trainable=False, name="W2")
            self.b2 = tf.Variable(weights["b2"], trainable=False, name="b2")

        @tf.function
        def serve(self, input):  # noqa: A002 - the signature's input key is the argument name
            hidden = tf.nn.relu(tf.matmul(input, self.w1) + self.b1)  # [B, H]
            logits = tf.matmul(hidden, self.w2) + self.b2  # [B, 10]
            probabilities = tf.nn.softmax(logits, axis=-1)
            label = tf.argmax(logits, axis=-1, output_type=tf.int64)  # [B]
            return {"probabilities": probabilities, "label": label}

    return DigitsMLP()
