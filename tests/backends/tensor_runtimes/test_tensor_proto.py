"""TensorProto conversion in the TF Serving adapter, checked against TensorFlow's own codec."""

from __future__ import annotations

import numpy as np
import pytest

from backends.base import TensorSpec
from backends.errors import (
    BackendInternalError,
    BackendTimeout,
    BackendUnavailable,
    InvalidInput,
    ModelNotFound,
)
from backends.tfserving import from_tensor_proto, map_rpc_error, to_tensor_proto, zeros_for

tf = pytest.importorskip("tensorflow")
grpc = pytest.importorskip("grpc")
from tensorflow.core.framework import tensor_pb2  # noqa: E402

NUMERIC = [
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
]


def _sample(datatype: str, shape=(2, 3)) -> np.ndarray:  # type: ignore[no-untyped-def]
    from backends.base import V2_TO_NUMPY

    rng = np.random.default_rng(0)
    dtype = V2_TO_NUMPY[datatype]
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind == "f":
        return (rng.standard_normal(shape) * 100).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


@pytest.mark.parametrize("datatype", NUMERIC)
def test_numeric_roundtrip_matches_tensorflow(datatype):
    array = _sample(datatype)
    ours = to_tensor_proto(tensor_pb2, array, datatype)
    decoded_by_tf = tf.make_ndarray(ours)
    assert decoded_by_tf.dtype == array.dtype
    np.testing.assert_array_equal(decoded_by_tf, array)
    # TensorFlow's encoder (what a real server answers with), decoded by us
    theirs = tf.make_tensor_proto(array)
    back = from_tensor_proto(theirs)
    assert back.dtype == array.dtype and back.shape == array.shape
    np.testing.assert_array_equal(back, array)


def test_bytes_roundtrip_matches_tensorflow():
    array = np.array([[b"abc", b""], [b"\xff\x00", "unicode \u00e9".encode()]], dtype=object)
    ours = to_tensor_proto(tensor_pb2, array, "BYTES")
    np.testing.assert_array_equal(tf.make_ndarray(ours), array)
    back = from_tensor_proto(tf.make_tensor_proto(array))
    assert back.dtype == object and back.shape == (2, 2)
    assert back.tolist() == array.tolist()


@pytest.mark.parametrize(
    "datatype", ["FP32", "FP64", "INT32", "INT64", "BOOL", "FP16", "UINT8", "UINT32", "UINT64"]
)
def test_typed_value_fields_and_short_forms(datatype):
    """Values in the repeated *_val fields, including TF's 'last value repeats' shortening."""
    array = _sample(datatype, (4,))
    full = tf.make_tensor_proto(array)
    typed = tensor_pb2.TensorProto(dtype=full.dtype, tensor_shape=full.tensor_shape)
    field = {"FP16": "half_val", "FP32": "float_val", "FP64": "double_val", "BOOL": "bool_val"}.get(datatype)
    if datatype == "FP16":
        typed.half_val.extend(array.view(np.uint16).tolist())
    elif field is None:
        field = {"INT64": "int64_val", "UINT32": "uint32_val", "UINT64": "uint64_val"}.get(
            datatype, "int_val"
        )
        getattr(typed, field).extend(array.tolist())
    else:
        getattr(typed, field).extend(array.tolist())
    np.testing.assert_array_equal(from_tensor_proto(typed), array)
    constant = tf.make_tensor_proto(np.full((3, 2), array[0]), dtype=full.dtype)
    filled = tensor_pb2.TensorProto(dtype=full.dtype, tensor_shape=constant.tensor_shape)
    if datatype == "FP16":
        filled.half_val.append(int(array[:1].view(np.uint16)[0]))
    else:
        getattr(filled, field).append(array[0].item())
    np.testing.assert_array_equal(from_tensor_proto(filled), np.full((3, 2), array[0]))


def test_bad_protos_raise_value_error():
    wrong_count = to_tensor_proto(tensor_pb2, np.zeros((2, 2), np.float32), "FP32")
    wrong_count.tensor_shape.dim[0].size = 3
    with pytest.raises(ValueError, match="needs 6"):
        from_tensor_proto(wrong_count)
    with pytest.raises(ValueError, match="unsupported"):
        from_tensor_proto(tensor_pb2.TensorProto(dtype=8))  # DT_COMPLEX64


def test_zeros_for_spec():
    assert zeros_for(TensorSpec(name="x", datatype="FP32", shape=(-1, 64))).shape == (1, 64)
    assert zeros_for(TensorSpec(name="s", datatype="BYTES", shape=(2,))).tolist() == [b"", b""]


class _FakeRpcError:
    """Failure injection: only the two accessors map_rpc_error reads."""

    def __init__(self, code, details: str) -> None:  # type: ignore[no-untyped-def]
        self._code, self._details = code, details

    def code(self):  # type: ignore[no-untyped-def]
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "error", "status"),
    [
        ("NOT_FOUND", ModelNotFound, 404),
        ("INVALID_ARGUMENT", InvalidInput, 400),
        ("UNAVAILABLE", BackendUnavailable, 503),
        ("DEADLINE_EXCEEDED", BackendTimeout, 504),
        ("INTERNAL", BackendInternalError, 500),
        ("RESOURCE_EXHAUSTED", BackendInternalError, 500),
    ],
)
def test_status_code_mapping(code, error, status):
    mapped = map_rpc_error(_FakeRpcError(getattr(grpc.StatusCode, code), "line one\nline two"), "Predict")
    assert type(mapped) is error
    assert mapped.status == status
    assert mapped.message == f"Predict: {code}: line one"
