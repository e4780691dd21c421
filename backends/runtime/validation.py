"""Check a tensor request against a model's metadata before it reaches a runtime.

A runtime fed the wrong shape fails with a message about its own internals (or worse, succeeds on
garbage); the caller deserves a 400 that names the input and says what was expected.
"""

from __future__ import annotations

import math

import numpy as np

from backends.base import ModelMetadata, TensorRequest, TensorSpec
from backends.errors import InvalidInput


def _shape_matches(expected: tuple[int, ...], got: tuple[int, ...]) -> bool:
    if len(expected) != len(got):
        return False
    return all(e == -1 or e == g for e, g in zip(expected, got, strict=True))


def _fmt_shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("-1" if d == -1 else str(d) for d in shape) + "]"


def check_tensor(spec: TensorSpec, datatype: str, shape: tuple[int, ...], data: np.ndarray) -> None:
    """Raise InvalidInput unless one input matches its spec and its data matches its shape."""
    if datatype != spec.datatype:
        raise InvalidInput(
            f"input {spec.name!r}: datatype {datatype} does not match the model's {spec.datatype}"
        )
    if any(d < 0 for d in shape):
        raise InvalidInput(f"input {spec.name!r}: shape {list(shape)} has a negative dimension")
    if not _shape_matches(spec.shape, shape):
        raise InvalidInput(
            f"input {spec.name!r}: shape {list(shape)} does not match the model's {_fmt_shape(spec.shape)}"
        )
    expected = math.prod(shape)
    if data.size != expected:
        raise InvalidInput(
            f"input {spec.name!r}: {data.size} elements given, shape {list(shape)} needs {expected}"
        )


def validate_request(request: TensorRequest, metadata: ModelMetadata) -> dict[str, np.ndarray]:
    """Check names, datatypes, shapes and element counts; return input name -> array.

    Raises:
        InvalidInput: naming the first offending input or output.
    """
    specs = {s.name: s for s in metadata.inputs}
    arrays: dict[str, np.ndarray] = {}
    for tensor in request.inputs:
        spec = specs.get(tensor.name)
        if spec is None:
            raise InvalidInput(f"unknown input {tensor.name!r}; the model's inputs are {sorted(specs)}")
        if tensor.name in arrays:
            raise InvalidInput(f"input {tensor.name!r} is given twice")
        check_tensor(spec, tensor.datatype, tuple(tensor.shape), tensor.data)
        arrays[tensor.name] = tensor.data.reshape(tensor.shape)
    missing = sorted(set(specs) - set(arrays))
    if missing:
        raise InvalidInput(f"missing input(s) {missing}")
    if request.outputs is not None:
        known = {s.name for s in metadata.outputs}
        unknown = [name for name in request.outputs if name not in known]
        if unknown:
            raise InvalidInput(f"unknown output(s) {unknown}; the model's outputs are {sorted(known)}")
    return arrays


def require_finite(array: np.ndarray, name: str, datatype: str) -> None:
    """Refuse NaN and infinities in a float input, on every protocol (JSON numbers cannot be either; binary and gRPC tensors are checked here): a
    model answers NaN for them, which reads as a result rather than as the client's mistake."""
    if not np.isfinite(array).all():
        raise InvalidInput(f"input {name!r}: {datatype} values must be finite numbers, not NaN or infinity")
