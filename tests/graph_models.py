"""Small ONNX models for the model-graph tests and bench, built with `onnx.helper`, and the same
functions computed by hand with numpy (what a graph's answer must equal).

- `scale.onnx`: `raw` FP32 [-1, 64] -> `scaled` = raw / 16 (the pre-processing step)
- `mlp_a.onnx`, `mlp_b.onnx`: `x` FP32 [-1, 64] -> `probs` FP32 [-1, 10], softmax(relu(x W1 + b1) W2 + b2),
  two different random weight sets (two classifiers to ensemble or to cascade)
- `average.onnx`: `a`, `b` FP32 [-1, 10] -> `mean` = (a + b) / 2
- `ids.onnx`: `ids` INT64 [-1] -> `same` (a model whose input no FP32 tensor fits)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class GraphModels:
    scale: Path
    mlp_a: Path
    mlp_b: Path
    average: Path
    ids: Path
    weights: dict[str, dict[str, np.ndarray]]


def _mlp_weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "W1": rng.normal(0, 0.6, (64, 32)).astype(np.float32),
        "b1": rng.normal(0, 0.1, 32).astype(np.float32),
        "W2": rng.normal(0, 0.6, (32, 10)).astype(np.float32),
        "b2": rng.normal(0, 0.1, 10).astype(np.float32),
    }


def _save(graph: object, path: Path) -> Path:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _tensor(name: str, dtype: int, shape: list[int | str]) -> object:
    from onnx import helper

    return helper.make_tensor_value_info(name, dtype, shape)


def write_graph_models(out: Path) -> GraphModels:
    from onnx import TensorProto, helper, numpy_helper

    fp32 = TensorProto.FLOAT
    scale = helper.make_graph(
        [helper.make_node("Mul", ["raw", "k"], ["scaled"])],
        "scale",
        [_tensor("raw", fp32, ["N", 64])],
        [_tensor("scaled", fp32, ["N", 64])],
        [numpy_helper.from_array(np.array(1 / 16, dtype=np.float32), "k")],
    )
    weights = {"mlp_a": _mlp_weights(1), "mlp_b": _mlp_weights(2)}
    paths = {}
    for name, w in weights.items():
        graph = helper.make_graph(
            [
                helper.make_node("MatMul", ["x", "W1"], ["h0"]),
                helper.make_node("Add", ["h0", "b1"], ["h1"]),
                helper.make_node("Relu", ["h1"], ["h2"]),
                helper.make_node("MatMul", ["h2", "W2"], ["l0"]),
                helper.make_node("Add", ["l0", "b2"], ["logits"]),
                helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
            ],
            name,
            [_tensor("x", fp32, ["N", 64])],
            [_tensor("probs", fp32, ["N", 10])],
            [numpy_helper.from_array(v, k) for k, v in w.items()],
        )
        paths[name] = _save(graph, out / f"{name}.onnx")
    average = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Mul", ["s", "half"], ["mean"])],
        "average",
        [_tensor("a", fp32, ["N", 10]), _tensor("b", fp32, ["N", 10])],
        [_tensor("mean", fp32, ["N", 10])],
        [numpy_helper.from_array(np.array(0.5, dtype=np.float32), "half")],
    )
    ids = helper.make_graph(
        [helper.make_node("Identity", ["ids"], ["same"])],
        "ids",
        [_tensor("ids", TensorProto.INT64, ["N"])],
        [_tensor("same", TensorProto.INT64, ["N"])],
    )
    return GraphModels(
        scale=_save(scale, out / "scale.onnx"),
        mlp_a=paths["mlp_a"],
        mlp_b=paths["mlp_b"],
        average=_save(average, out / "average.onnx"),
        ids=_save(ids, out / "ids.onnx"),
        weights=weights,
    )


def mlp_by_hand(w: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """What `mlp_a.onnx` / `mlp_b.onnx` compute, in float64 numpy."""
    h = np.maximum(x.astype(np.float64) @ w["W1"] + w["b1"], 0.0)
    logits = h @ w["W2"] + w["b2"]
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def ensemble_by_hand(models: GraphModels, raw: np.ndarray) -> np.ndarray:
    """The three-step graph computed step by step: scale, both classifiers, their mean."""
    scaled = raw.astype(np.float32) / 16
    return (mlp_by_hand(models.weights["mlp_a"], scaled) + mlp_by_hand(models.weights["mlp_b"], scaled)) / 2


def step_sections(models: GraphModels) -> tuple[dict, dict]:
    """`deployments:` and `models:` of a gateway serving the step models: the pre-processing and the
    average on ONNX Runtime, `mlp-a` on ONNX Runtime, `mlp-b` on OpenVINO (falling back to ONNX Runtime)."""
    deployments = {
        "scale-ort": {"backend": "onnxruntime", "model": str(models.scale)},
        "a-ort": {"backend": "onnxruntime", "model": str(models.mlp_a)},
        "b-ov": {"backend": "openvino", "model": str(models.mlp_b)},
        "b-ort": {"backend": "onnxruntime", "model": str(models.mlp_b)},
        "avg-ort": {"backend": "onnxruntime", "model": str(models.average)},
        "ids-ort": {"backend": "onnxruntime", "model": str(models.ids)},
    }
    served = {
        "scale": {"routes": [{"deployment": "scale-ort"}]},
        "mlp-a": {"routes": [{"deployment": "a-ort"}]},
        "mlp-b": {"routes": [{"deployment": "b-ov"}], "fallback": ["b-ort"]},
        "average": {"routes": [{"deployment": "avg-ort"}]},
        "ids": {"routes": [{"deployment": "ids-ort"}]},
    }
    return deployments, served


def ensemble_steps() -> dict:
    """The three-step graph's `steps:`: scale, both classifiers on the scaled pixels, their mean."""
    return {
        "pre": {"model": "scale", "inputs": {"raw": "request.pixels"}},
        "a": {"model": "mlp-a", "inputs": {"x": "pre.scaled"}},
        "b": {"model": "mlp-b", "inputs": {"x": "pre.scaled"}},
        "mean": {"model": "average", "inputs": {"a": "a.probs", "b": "b.probs"}},
    }
