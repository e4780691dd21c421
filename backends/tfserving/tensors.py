"""TensorFlow tensors <-> numpy and v2: TensorProto encoding, dtypes, signature tensor specs."""

from __future__ import annotations

from typing import Any

import numpy as np

from backends.base import V2_TO_NUMPY, TensorSpec

#: TensorFlow DataType enum value (tensorflow/core/framework/types.proto, wire-stable) -> v2 datatype
DT_TO_V2: dict[int, str] = {
    1: "FP32",  # DT_FLOAT
    2: "FP64",  # DT_DOUBLE
    3: "INT32",  # DT_INT32
    4: "UINT8",  # DT_UINT8
    5: "INT16",  # DT_INT16
    6: "INT8",  # DT_INT8
    7: "BYTES",  # DT_STRING
    9: "INT64",  # DT_INT64
    10: "BOOL",  # DT_BOOL
    17: "UINT16",  # DT_UINT16
    19: "FP16",  # DT_HALF
    22: "UINT32",  # DT_UINT32
    23: "UINT64",  # DT_UINT64
}
V2_TO_DT: dict[str, int] = {v: k for k, v in DT_TO_V2.items()}

#: the repeated field a TensorProto uses when it carries values without `tensor_content`
_VALUE_FIELD = {
    "FP32": "float_val",
    "FP64": "double_val",
    "INT32": "int_val",
    "INT16": "int_val",
    "INT8": "int_val",
    "UINT8": "int_val",
    "UINT16": "int_val",
    "INT64": "int64_val",
    "BOOL": "bool_val",
    "FP16": "half_val",  # the float16 bit patterns as ints
    "UINT32": "uint32_val",
    "UINT64": "uint64_val",
}


def to_tensor_proto(tensor_pb2: Any, array: np.ndarray, datatype: str) -> Any:
    """A numpy array as a TensorProto: raw little-endian bytes, or `string_val` for BYTES."""
    proto = tensor_pb2.TensorProto(dtype=V2_TO_DT[datatype])
    for size in array.shape:
        proto.tensor_shape.dim.add(size=int(size))
    if datatype == "BYTES":
        proto.string_val.extend(v if isinstance(v, bytes) else str(v).encode() for v in array.ravel())
    else:
        little = V2_TO_NUMPY[datatype].newbyteorder("<")
        proto.tensor_content = np.ascontiguousarray(array, dtype=little).tobytes()
    return proto


def from_tensor_proto(proto: Any) -> np.ndarray:
    """A TensorProto as a numpy array, whichever of its encodings the server chose.

    Raises:
        ValueError: an unsupported dtype or a value count that does not fit the shape.
    """
    datatype = DT_TO_V2.get(proto.dtype)
    if datatype is None:
        raise ValueError(f"unsupported TensorFlow dtype {proto.dtype}")
    shape = tuple(int(d.size) for d in proto.tensor_shape.dim)
    count = int(np.prod(shape, dtype=np.int64))
    dtype = V2_TO_NUMPY[datatype]
    if datatype != "BYTES" and proto.tensor_content:
        flat = np.frombuffer(proto.tensor_content, dtype=dtype.newbyteorder("<")).astype(dtype)
    elif datatype == "BYTES":
        flat = np.empty(len(proto.string_val), dtype=object)
        flat[:] = list(proto.string_val)
    elif datatype == "FP16":
        flat = np.asarray(proto.half_val, dtype=np.uint16).view(np.float16)
    else:
        flat = np.asarray(getattr(proto, _VALUE_FIELD[datatype]), dtype=dtype)
    if flat.size != count:
        # TensorFlow's own encoding may shorten a tensor whose trailing values repeat the last one.
        if flat.size == 0 or flat.size > count or datatype != "BYTES" and proto.tensor_content:
            raise ValueError(f"tensor holds {flat.size} values, shape {list(shape)} needs {count}")
        flat = np.concatenate([flat, np.repeat(flat[-1:], count - flat.size)])
    return flat.reshape(shape)


def signature_spec(key: str, info: Any) -> TensorSpec:
    """A signature's TensorInfo as a v2 TensorSpec (-1 for unknown dimensions).

    Raises:
        RuntimeError: a dtype the gateway cannot serve, or an unknown rank.
    """
    datatype = DT_TO_V2.get(info.dtype)
    if datatype is None:
        raise RuntimeError(
            f"signature tensor {key!r} has TensorFlow dtype {info.dtype}, which the gateway cannot serve"
        )
    if info.tensor_shape.unknown_rank:
        raise RuntimeError(
            f"signature tensor {key!r} has an unknown rank; export the model with a fixed rank"
        )
    return TensorSpec(name=key, datatype=datatype, shape=tuple(int(d.size) for d in info.tensor_shape.dim))
