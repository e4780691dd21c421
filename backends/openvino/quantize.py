"""Post-training INT8 quantization of an ONNX or OpenVINO IR model with NNCF, for Intel CPUs.

`fleetgate quantize` calls `quantize_to_int8`: NNCF runs the f32 model on calibration rows,
records activation ranges and inserts FakeQuantize operations; OpenVINO's CPU plugin then runs the
quantized matmuls and convolutions with int8 kernels (VNNI/AMX where the CPU has them). The result
is an ordinary IR (`.xml` + `.bin`) that the openvino backend serves as it serves any other.

Everything a caller can get wrong (the calibration file, its shape against the model's input, a
model with several inputs) is checked before NNCF runs and reported as one `ValueError` line:
NNCF's own errors for those cases come late and name internal graph nodes.

nncf and openvino are imported inside the functions: the gateway never imports this module on the
request path, and the command needs the `quantize` extra only when it is used.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from backends.runtime.lazy import require

#: rows per inference while collecting statistics: one row per call would make calibration of a
#: small model a Python loop over hundreds of inferences for no better ranges
CALIBRATION_BATCH = 32
PRESETS = ("performance", "mixed")
#: operations whose int8 execution is the point of quantizing
_COMPUTE_OPS = frozenset({"MatMul", "Convolution", "GroupConvolution", "ConvolutionBackpropData"})
#: operations between a FakeQuantize (or an int8 weight) and the op that consumes it in a saved IR:
#: layout changes, and the Convert/Subtract/Multiply that dequantize compressed weights
_PASS_THROUGH = frozenset(
    {"Reshape", "Squeeze", "Unsqueeze", "Transpose", "MaxPool", "Convert", "Subtract", "Multiply"}
)

Calibration = np.ndarray | dict[str, np.ndarray]


def load_calibration(source: np.ndarray | str | Path) -> Calibration:
    """An array, or the arrays of a `.npy` / `.npz` file (an `.npz` keeps its keys).

    Raises:
        ValueError: the file is missing, not .npy/.npz, or numpy cannot read it.
    """
    if isinstance(source, np.ndarray):
        return source
    path = Path(source)
    if path.suffix not in (".npy", ".npz"):
        raise ValueError(f"calibration file {path} must be a .npy (one array) or .npz file")
    if not path.is_file():
        raise ValueError(f"calibration file {path} does not exist")
    try:
        if path.suffix == ".npy":
            return np.load(path, allow_pickle=False)
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"cannot read calibration file {path}: {exc}") from None


def _names(port: Any) -> set[str]:
    return set(port.get_names()) or {port.get_any_name()}


def _pick_input(inputs: list[Any], input_name: str | None) -> Any:
    """The model input the calibration array feeds."""
    listed = ", ".join(sorted(p.get_any_name() for p in inputs))
    if input_name is None:
        if len(inputs) != 1:
            raise ValueError(
                f"the model has {len(inputs)} inputs ({listed}): name the one the calibration data "
                "feeds (input_name / --input NAME)"
            )
        return inputs[0]
    for port in inputs:
        if input_name in _names(port):
            return port
    raise ValueError(f"the model has no input {input_name!r} (its inputs: {listed})")


def _array_for(calibration: Calibration, port: Any, *, main: bool) -> np.ndarray | None:
    """The calibration array of one input: the npz entry named like it, or the only array."""
    if isinstance(calibration, np.ndarray):
        return calibration if main else None
    for name in sorted(_names(port)):
        if name in calibration:
            return calibration[name]
    if main and len(calibration) == 1:
        return next(iter(calibration.values()))
    if main:
        keys = ", ".join(sorted(calibration)) or "none"
        raise ValueError(
            f"the calibration .npz has no array named {port.get_any_name()!r} (its arrays: {keys}); "
            "save it under the input's name or save a single array"
        )
    return None


def _check_rows(rows: np.ndarray, port: Any) -> np.ndarray:
    """Rows [N, *features] fitting the input's rank, static dimensions and element type."""
    name = port.get_any_name()
    if rows.ndim == 0 or len(rows) == 0:
        raise ValueError(f"the calibration set for input {name!r} is empty (shape {rows.shape})")
    shape = port.get_partial_shape()
    fits = shape.rank.is_dynamic or (
        len(shape) == rows.ndim
        and all(
            d.is_dynamic or d.get_length() == n for d, n in zip(list(shape)[1:], rows.shape[1:], strict=True)
        )
    )
    if not fits:
        raise ValueError(
            f"calibration rows have shape {tuple(rows.shape)} but the model's input {name!r} has shape "
            f"{port.get_partial_shape()}: each row must match the input past its first (batch) dimension"
        )
    target = np.dtype(port.get_element_type().to_dtype())
    if not np.can_cast(rows.dtype, target, casting="same_kind"):
        raise ValueError(
            f"calibration rows for input {name!r} are {rows.dtype}, which does not convert to the "
            f"model's {target}"
        )
    rows = np.ascontiguousarray(rows, dtype=target)
    if rows.dtype.kind == "f" and not np.isfinite(rows).all():
        raise ValueError(f"the calibration rows for input {name!r} hold NaN or infinite values")
    return rows


def _static_batch(port: Any) -> int | None:
    """The input's batch dimension when it is fixed (calibration batches must have exactly that)."""
    shape = port.get_partial_shape()
    if shape.rank.is_static and len(shape) > 0 and shape[0].is_static:
        return shape[0].get_length()
    return None


def calibration_feeds(
    model: Any,
    calibration: np.ndarray | str | Path | Mapping[str, np.ndarray],
    input_name: str | None = None,
    subset_size: int = 300,
) -> list[dict[str, np.ndarray]]:
    """The calibration data as a list of batches, each a feed {input name: rows}.

    A model with several inputs needs `input_name` (what a bare array feeds) and an `.npz` (or a
    mapping) holding the other inputs' rows under their names.

    Raises:
        ValueError: see the module docstring.
    """
    if subset_size < 1:
        raise ValueError(f"subset_size must be >= 1, not {subset_size}")
    data: Calibration = (
        dict(calibration) if isinstance(calibration, Mapping) else load_calibration(calibration)
    )
    inputs = list(model.inputs)
    main = _pick_input(inputs, input_name)
    arrays = {main.get_any_name(): _check_rows(np.asarray(_array_for(data, main, main=True)), main)}
    missing = []
    for port in inputs:
        if port is main or port.get_any_name() == main.get_any_name():
            continue
        other = _array_for(data, port, main=False)
        if other is None:
            missing.append(port.get_any_name())
        else:
            arrays[port.get_any_name()] = _check_rows(np.asarray(other), port)
    if missing:
        raise ValueError(
            f"model input(s) {', '.join(missing)} have no calibration data: save every input's rows in "
            "the .npz under the input's name"
        )
    counts = {len(a) for a in arrays.values()}
    if len(counts) != 1:
        raise ValueError(f"the calibration arrays have different row counts: {sorted(counts)}")
    rows = min(counts.pop(), subset_size)
    fixed = _static_batch(main)
    if fixed is not None and rows < fixed:
        raise ValueError(
            f"the model's batch dimension is fixed at {fixed} but only {rows} calibration rows are used"
        )
    step = fixed or CALIBRATION_BATCH
    usable = rows - rows % step if fixed else rows
    return [
        {name: a[start : min(start + step, usable)] for name, a in arrays.items()}
        for start in range(0, usable, step)
    ]


def _reads_int8(output: Any, hops: int = 4) -> bool:
    """Whether a value comes from a FakeQuantize or an int8 constant, through layout and dequantize ops."""
    node = output.get_node()
    kind = node.get_type_name()
    if kind == "FakeQuantize":
        return True
    if kind == "Constant":
        return node.get_output_element_type(0).get_type_name() in ("i8", "u8")
    if kind in _PASS_THROUGH and hops > 0:
        return _reads_int8(node.input(0).get_source_output(), hops - 1)
    return False


def quantized_op_counts(model: Any) -> dict[str, int]:
    """What makes an IR quantized: FakeQuantize ops, the matmuls/convolutions reading quantized
    values (activations through a FakeQuantize, or int8 weights), and the int8 weight tensors.

    `model` is an `openvino.Model` or the path of an IR/ONNX file.
    """
    if not hasattr(model, "get_ordered_ops"):
        model = require("openvino", extra="openvino").Core().read_model(str(model))
    counts = {"fake_quantize": 0, "quantized_ops": 0, "int8_weights": 0}
    for op in model.get_ordered_ops():
        kind = op.get_type_name()
        if kind == "FakeQuantize":
            counts["fake_quantize"] += 1
        elif kind in _COMPUTE_OPS and any(_reads_int8(i.get_source_output()) for i in op.inputs()):
            counts["quantized_ops"] += 1
        elif kind == "Constant" and op.get_output_element_type(0).get_type_name() in ("i8", "u8"):
            counts["int8_weights"] += 1
    return counts


def _read_model(core: Any, model_path: Path) -> Any:
    if model_path.suffix not in (".xml", ".onnx"):
        raise ValueError(f"model {model_path} must be an OpenVINO IR .xml or an .onnx file")
    if not model_path.is_file():
        raise ValueError(f"model {model_path} is not a file")
    try:
        return core.read_model(str(model_path))
    except Exception as exc:
        from backends.openvino.ports import one_line

        raise ValueError(f"cannot read model {model_path}: {one_line(exc)}") from None


def quantize_to_int8(
    model_path: str | Path,
    calibration: np.ndarray | str | Path | Mapping[str, np.ndarray],
    out_xml: str | Path,
    *,
    input_name: str | None = None,
    subset_size: int = 300,
    preset: str = "performance",
) -> Path:
    """Quantize a model to INT8 on calibration rows and write it as an IR; returns the `.xml`.

    Args:
        model_path: an `.onnx` or OpenVINO IR `.xml` (f32).
        calibration: rows shaped like the model's input with a leading row axis (an array, or a
            `.npy` / `.npz` file; an `.npz` entry is picked by the input's name, or is the only one).
        out_xml: where to write the INT8 IR (its `.bin` goes beside it).
        input_name: the input the calibration rows feed; required when the model has several.
        subset_size: at most this many rows are used (NNCF's default, 300, is plenty for ranges).
        preset: "performance" (symmetric activations: fastest on CPU) or "mixed" (asymmetric
            activations: better for inputs that are not centred on zero, such as after a GELU).

    Raises:
        ValueError: the model, the calibration data or an argument cannot work (one line saying why).
        MissingRuntime: openvino or nncf is not installed.
    """
    ov = require("openvino", extra="openvino")
    out_xml = Path(out_xml)
    if out_xml.suffix != ".xml":
        raise ValueError(f"{out_xml}: an OpenVINO IR file name must end in .xml")
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, not {preset!r}")
    if out_xml.resolve() == Path(model_path).resolve():
        # OpenVINO maps the source's .bin into memory: writing over it would corrupt the weights it reads
        raise ValueError(f"{out_xml}: write the INT8 IR beside the f32 model, not over it")
    model = _read_model(ov.Core(), Path(model_path))
    feeds = calibration_feeds(model, calibration, input_name, subset_size)
    nncf = require("nncf", extra="quantize")
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters

    previous = logging.getLogger("nncf").level
    nncf.set_log_level(logging.WARNING)  # its INFO lines go to stdout, where the CLI prints its answer
    try:
        quantized = nncf.quantize(
            model,
            nncf.Dataset(feeds),
            preset=nncf.QuantizationPreset(preset),
            target_device=nncf.TargetDevice.CPU,
            subset_size=len(feeds),  # NNCF counts dataset items, here batches
            # the feeds are batches: ranges come from every row, not from per-batch extremes
            advanced_parameters=AdvancedQuantizationParameters(batchwise_statistics=True),
        )
    finally:
        nncf.set_log_level(previous)
    out_xml.parent.mkdir(parents=True, exist_ok=True)
    # compress_to_fp16=False: the layers NNCF leaves in f32 must stay f32 (f16 weights move results)
    ov.save_model(quantized, str(out_xml), compress_to_fp16=False)
    return out_xml
