"""INT8 post-training quantization for OpenVINO (backends/openvino/quantize.py, `fleetgate quantize`).

Real NNCF and OpenVINO on the demo digits MLP (quantized from its f32 IR) and the small digits CNN
(quantized from ONNX), both trained here in seconds and calibrated on the training split: the INT8
IR keeps top-1 accuracy on the held-out split within one point of f32, really holds quantized ops
that the CPU plugin runs in int8 under the backend's f32 precision hint, and the gateway's openvino
backend serves it unchanged. The command is run once as a subprocess (the real entry point); its
refusals are checked in process.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from backends import openvino as ov_backend
from backends.base import Tensor, TensorRequest
from backends.demo_models.cnn import write_digits_cnn
from backends.demo_models.digits import digits_split, write_digits
from backends.demo_models.exports import write_openvino_ir
from backends.openvino.quantize import calibration_feeds, quantize_to_int8, quantized_op_counts
from backends.spec import DeploymentSpec
from gateway.serve.cli import main

#: the backend's default compile config: f32 must stay exact, int8 layers must still run in int8
F32 = {"INFERENCE_PRECISION_HINT": "f32"}


@dataclass(frozen=True)
class Pair:
    """An f32 model, its INT8 IR and the data it was calibrated and judged on."""

    name: str
    f32: Path
    int8: Path
    x_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    #: matmuls and convolutions in the model (each should come out quantized)
    compute_ops: int


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    out = tmp_path_factory.mktemp("int8-mlp")
    onnx_path = write_digits(out).onnx_path
    f32 = write_openvino_ir(onnx_path, out / "digits.xml")  # quantize from an IR here, from ONNX for the CNN
    x_train, x_test, _, y_test = digits_split()
    int8 = quantize_to_int8(f32, x_train, out / "int8" / "digits_int8.xml")
    return Pair("mlp", f32, int8, x_train, x_test, y_test, compute_ops=2)


@pytest.fixture(scope="module")
def cnn(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    out = tmp_path_factory.mktemp("int8-cnn")
    model = write_digits_cnn(out)
    calibration = out / "calibration.npz"
    np.savez(calibration, input=model.x_train)  # the file form, keyed by the input's name
    int8 = quantize_to_int8(model.onnx_path, calibration, out / "digits_cnn_int8.xml")
    return Pair("cnn", model.onnx_path, int8, model.x_train, model.x_test, model.y_test, compute_ops=3)


@pytest.fixture(params=["mlp", "cnn"])
def pair(request: pytest.FixtureRequest) -> Pair:
    return request.getfixturevalue(request.param)


def _compiled(path: Path):  # type: ignore[no-untyped-def]
    import openvino as ov

    return ov.Core().compile_model(str(path), "CPU", F32)


def _top1(path: Path, x: np.ndarray, y: np.ndarray) -> float:
    probabilities = _compiled(path)({0: x})[0]
    return float((probabilities.argmax(axis=1) == y).mean())


def test_int8_top1_within_one_point_of_f32(pair: Pair) -> None:
    f32 = _top1(pair.f32, pair.x_test, pair.y_test)
    int8 = _top1(pair.int8, pair.x_test, pair.y_test)
    assert f32 > 0.95, f"{pair.name}: the f32 model itself is off ({f32:.4f})"
    assert abs(int8 - f32) <= 0.01, f"{pair.name}: f32 {f32:.4f} vs int8 {int8:.4f}"


def test_int8_ir_holds_quantized_ops_that_run_in_int8(pair: Pair) -> None:
    counts = quantized_op_counts(pair.int8)
    assert counts["fake_quantize"] > 0
    assert counts["quantized_ops"] == pair.compute_ops
    assert counts["int8_weights"] == pair.compute_ops
    assert quantized_op_counts(pair.f32) == {"fake_quantize": 0, "quantized_ops": 0, "int8_weights": 0}
    # The weights stayed f32 where NNCF left them (no f16 compression by save_model).
    assert pair.int8.with_suffix(".bin").is_file()
    runtime = _compiled(pair.int8).get_runtime_model()
    int8_layers = [
        op.get_rt_info()["layerType"].astype(str)
        for op in runtime.get_ordered_ops()
        if op.get_rt_info()["runtimePrecision"].astype(str) in ("u8", "i8")
        and op.get_rt_info()["layerType"].astype(str) in ("Convolution", "FullyConnected", "MatMul")
    ]
    assert len(int8_layers) == pair.compute_ops, int8_layers


async def test_openvino_backend_serves_the_int8_ir(pair: Pair) -> None:
    backend = ov_backend.create(f"{pair.name}-int8", DeploymentSpec(backend="openvino", model=str(pair.int8)))
    await backend.load()
    await backend.warmup()
    try:
        meta = backend.metadata()
        assert meta.platform == "openvino_ir"
        assert [(s.name, s.datatype, s.shape) for s in meta.inputs] == [
            ("input", "FP32", (-1, *pair.x_test.shape[1:]))
        ]
        x = pair.x_test[:64]
        response = await backend.infer(TensorRequest(id="q", inputs=[Tensor.from_array("input", x)]))
        got = {t.name: t.data for t in response.outputs}
        direct = _compiled(pair.int8)({0: x})[0]
        np.testing.assert_allclose(got["probabilities"], direct, atol=1e-6)
        assert (got["probabilities"].argmax(axis=1) == pair.y_test[:64]).mean() > 0.9
    finally:
        await backend.close()


def test_cli_quantizes_end_to_end(mlp: Pair, tmp_path: Path) -> None:
    calibration = tmp_path / "calibration.npy"
    np.save(calibration, mlp.x_train)
    out = tmp_path / "cli" / "digits_int8.xml"
    done = subprocess.run(
        [sys.executable, "-m", "gateway.serve.cli", "quantize", "--model", str(mlp.f32)]
        + ["--calibration", str(calibration), "--out", str(out), "--subset-size", "100"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    # stdout is the one answer line (NNCF's progress bars go to stderr)
    assert done.stdout.strip() == f"{out}: 2 FakeQuantize, 2 quantized ops, 2 int8 weight tensors"
    assert out.is_file() and out.with_suffix(".bin").is_file()
    assert abs(_top1(out, mlp.x_test, mlp.y_test) - _top1(mlp.f32, mlp.x_test, mlp.y_test)) <= 0.01


def _bad_calibration(kind: str, tmp_path: Path, rows: np.ndarray) -> tuple[Path, list[str]]:
    """A calibration file that cannot work, and what the error line must say."""
    path = tmp_path / ("c.npz" if kind.startswith("npz") else "c.npy")
    if kind == "missing":
        return path, [str(path), "does not exist"]
    if kind == "narrow":
        np.save(path, rows[:, :63])
        return path, [f"({len(rows)}, 63)", "[?,64]"]
    if kind == "flat_images":
        np.save(path, rows.reshape(-1))
        return path, [f"({rows.size},)", "[?,64]"]
    if kind == "empty":
        np.save(path, rows[:0])
        return path, ["empty"]
    if kind == "garbage":
        path.write_bytes(b"not a numpy file")
        return path, ["cannot read calibration file", str(path)]
    if kind == "npz_unnamed":
        np.savez(path, a=rows, b=rows)
        return path, ["no array named 'input'", "a, b"]
    if kind == "strings":
        np.save(path, np.array([["x"] * 64]))
        return path, ["<U1", "float32"]
    raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind", ["missing", "narrow", "flat_images", "empty", "garbage", "npz_unnamed", "strings"]
)
def test_cli_refuses_bad_calibration_with_one_line(
    kind: str, mlp: Pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calibration, fragments = _bad_calibration(kind, tmp_path, mlp.x_train[:50])
    out = tmp_path / "never.xml"
    code = main(["quantize", "--model", str(mlp.f32), "--calibration", str(calibration), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.startswith("fleetgate: ") and captured.err.count("\n") == 1, captured.err
    for fragment in fragments:
        assert fragment in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""
    assert not out.exists()


def _two_input_model(path: Path) -> Path:
    """y = (a + b) @ W: a model whose calibration needs rows for both inputs."""
    import onnx

    h = onnx.helper
    w = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    graph = h.make_graph(
        [h.make_node("Add", ["a", "b"], ["s"]), h.make_node("MatMul", ["s", "W"], ["y"])],
        "two_inputs",
        [h.make_tensor_value_info(n, onnx.TensorProto.FLOAT, ["batch", 8]) for n in ("a", "b")],
        [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4])],
        initializer=[onnx.numpy_helper.from_array(w, name="W")],
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


def test_several_inputs_need_a_name_and_rows_for_each(tmp_path: Path) -> None:
    import openvino as ov

    onnx_path = _two_input_model(tmp_path / "two.onnx")
    model = ov.Core().read_model(str(onnx_path))
    rows = np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"the model has 2 inputs \(a, b\): name the one"):
        calibration_feeds(model, rows)
    with pytest.raises(ValueError, match="model input\\(s\\) b have no calibration data"):
        calibration_feeds(model, rows, input_name="a")
    with pytest.raises(ValueError, match="different row counts"):
        calibration_feeds(model, {"a": rows, "b": rows[:10]}, input_name="a")
    feeds = calibration_feeds(model, {"a": rows, "b": rows}, input_name="a", subset_size=35)
    assert [len(f["a"]) for f in feeds] == [32, 3] and [len(f["b"]) for f in feeds] == [32, 3]
    out = quantize_to_int8(onnx_path, {"a": rows, "b": rows}, tmp_path / "two_int8.xml", input_name="a")
    assert quantized_op_counts(out)["quantized_ops"] == 1


def test_arguments_checked_before_nncf_runs(mlp: Pair, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must end in .xml"):
        quantize_to_int8(mlp.f32, mlp.x_train, tmp_path / "out.bin")
    with pytest.raises(ValueError, match="preset must be one of performance, mixed"):
        quantize_to_int8(mlp.f32, mlp.x_train, tmp_path / "out.xml", preset="fast")
    with pytest.raises(ValueError, match="subset_size must be >= 1"):
        quantize_to_int8(mlp.f32, mlp.x_train, tmp_path / "out.xml", subset_size=0)
    with pytest.raises(ValueError, match="not over it"):
        quantize_to_int8(mlp.f32, mlp.x_train, mlp.f32)
    with pytest.raises(ValueError, match="is not a file"):
        quantize_to_int8(tmp_path / "missing.onnx", mlp.x_train, tmp_path / "out.xml")
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_to_int8(mlp.f32, np.full((4, 64), np.nan, np.float32), tmp_path / "out.xml")
    assert not (tmp_path / "out.xml").exists()
    # float64 rows are fine (converted), the input's shape comes from the model
    feeds = calibration_feeds(_read(mlp.f32), mlp.x_train.astype(np.float64))
    assert feeds[0]["input"].dtype == np.float32


def _read(path: Path):  # type: ignore[no-untyped-def]
    import openvino as ov

    return ov.Core().read_model(str(path))
