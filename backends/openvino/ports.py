"""OpenVINO ports and tensors as v2 specs and numpy arrays, and its errors as one line."""

from __future__ import annotations

from typing import Any

import numpy as np

from backends.base import NUMPY_TO_V2, TensorSpec


def one_line(exc: BaseException) -> str:
    """An OpenVINO exception as one short line (the reason, without source paths)."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__
    # OpenVINO messages start with a source path and `Check '...' failed`; the last line says why.
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if len(lines) > 1 else lines[0][:300]


def port_spec(port: Any) -> TensorSpec:
    """An OpenVINO input/output port as a v2 TensorSpec (-1 for dynamic dimensions)."""
    name = port.get_any_name()
    element = port.get_element_type()
    if element.get_type_name() == "string":
        datatype = "BYTES"
    else:
        datatype = NUMPY_TO_V2.get(np.dtype(element.to_dtype()), "")
    if not datatype:
        raise ValueError(
            f"tensor {name!r} has element type {element.get_type_name()}, which the gateway cannot serve"
        )
    shape = port.get_partial_shape()
    if shape.rank.is_dynamic:
        raise ValueError(f"tensor {name!r} has a dynamic rank; give the model a fixed rank")
    dims = tuple(d.get_length() if d.is_static else -1 for d in shape)
    return TensorSpec(name=name, datatype=datatype, shape=dims)


def read_tensor(tensor: Any) -> np.ndarray:
    """A copy of an OpenVINO tensor as numpy (its buffer is reused by the next inference)."""
    if tensor.get_element_type().get_type_name() == "string":
        return np.asarray(tensor.bytes_data, dtype=object).reshape(tuple(tensor.get_shape()))
    return np.array(tensor.data, copy=True)
