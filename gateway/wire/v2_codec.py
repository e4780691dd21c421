"""Open Inference Protocol v2 bodies <-> internal tensors, incl. the binary tensor data extension.

With the extension (what tritonclient sends by default) the body is a JSON header of
`Inference-Header-Content-Length` bytes followed by the raw bytes of each binary input, in input
order. BYTES elements travel as a 4-byte little-endian length followed by the bytes.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np

from backends.base import V2_TO_NUMPY, Tensor, TensorRequest, TensorResponse
from backends.errors import InvalidInput
from backends.runtime.json_errors import JSON_DECODE_ERRORS, describe_decode_error
from backends.runtime.validation import require_finite

#: what the v2 server metadata endpoints (HTTP and gRPC) answer
SERVER_NAME = "fleetgate"
SERVER_VERSION = "0.1.0"


class _InputJSON(msgspec.Struct, kw_only=True):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    data: Any = None


class _OutputJSON(msgspec.Struct, kw_only=True):
    name: str
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


class InferRequestJSON(msgspec.Struct, kw_only=True):
    id: str | None = None
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    inputs: list[_InputJSON]
    outputs: list[_OutputJSON] | None = None


_request_decoder = msgspec.json.Decoder(InferRequestJSON)
#: numpy dtype kind -> the JSON element type it accepts (f: numbers, b: booleans, others: integers)
_ELEMENT_LISTS: dict[str, Any] = {"f": list[float], "b": list[bool], "i": list[int], "u": list[int]}
_encoder = msgspec.json.Encoder()


class DecodedInfer(msgspec.Struct):
    request: TensorRequest
    #: output name -> send as binary; `None` key means the request-level default
    binary_outputs: dict[str, bool]
    binary_default: bool


#: the most dimensions a tensor may have (numpy's own limit is 64; models use a handful)
MAX_RANK = 32
#: the largest single dimension, and the most elements of one tensor: far above what fits a body
MAX_ELEMENTS = 2**40


def element_count(shape: list[int], name: str) -> int:
    """Elements in `shape`, after checks that cost O(rank) with small numbers.

    Rank and each dimension are capped before any arithmetic, so a body listing thousands of
    huge dimensions cannot make the product (or a message quoting it) quadratic. A zero dimension
    is refused: a tensor with no elements has nothing to infer, and its other dimensions would be
    charged as rows by the fair queue.
    """
    if len(shape) > MAX_RANK:
        raise InvalidInput(f"input {name!r}: shape has {len(shape)} dimensions; at most {MAX_RANK}")
    count = 1
    for d in shape:
        if type(d) is not int or not 0 < d <= MAX_ELEMENTS:
            raise InvalidInput(
                f"input {name!r}: each shape dimension must be an integer in [1, {MAX_ELEMENTS}]"
            )
        count *= d
        if count > MAX_ELEMENTS:
            raise InvalidInput(f"input {name!r}: shape holds more than {MAX_ELEMENTS} elements")
    return count


def bytes_from_binary(raw: memoryview, count: int, name: str) -> np.ndarray:
    items: list[bytes] = []
    offset = 0
    for _ in range(count):
        if offset + 4 > len(raw):
            raise InvalidInput(f"input {name!r}: binary BYTES data ends early")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidInput(f"input {name!r}: binary BYTES data ends early")
        items.append(bytes(raw[offset : offset + length]))
        offset += length
    if offset != len(raw):
        raise InvalidInput(f"input {name!r}: binary BYTES data has {len(raw) - offset} trailing bytes")
    return np.array(items, dtype=object)


def _flatten(data: Any, shape: list[int], name: str) -> list[Any]:
    """Row-major elements of v2 JSON data: flat, or nested exactly as `shape` says.

    Nested data is walked level by level, each list's length checked against its dimension, so
    ragged lists are refused even when their element count happens to match.
    """
    if not isinstance(data, list):
        return [data]
    if not data or not isinstance(data[0], list):
        return data
    level: list[Any] = [data]
    for depth, dim in enumerate(shape):
        below: list[Any] = []
        for item in level:
            if not isinstance(item, list) or len(item) != dim:
                raise InvalidInput(
                    f"input {name!r}: nested data does not match shape {shape} at depth {depth}"
                )
            below.extend(item)
        level = below
    if level and isinstance(level[0], list):
        raise InvalidInput(f"input {name!r}: nested data is deeper than shape {shape}")
    return level


def _array_from_json(inp: _InputJSON, count: int) -> np.ndarray:
    if inp.data is None:
        raise InvalidInput(f"input {inp.name!r} has neither `data` nor binary_data_size")
    flat = _flatten(inp.data, inp.shape, inp.name)
    if len(flat) != count:
        raise InvalidInput(f"input {inp.name!r}: {len(flat)} elements given, shape {inp.shape} needs {count}")
    if inp.datatype == "BYTES":
        if not all(isinstance(v, str | bytes) for v in flat):
            raise InvalidInput(f"input {inp.name!r}: BYTES data must be strings")
        return np.array([v.encode() if isinstance(v, str) else v for v in flat], dtype=object)
    dtype = V2_TO_NUMPY[inp.datatype]
    try:
        # One C pass checks every element's JSON type (msgspec never takes a bool for a number
        # or a float for an int), instead of a Python call per element.
        values = msgspec.convert(flat, _ELEMENT_LISTS[dtype.kind])
    except msgspec.ValidationError:
        raise InvalidInput(f"input {inp.name!r}: data does not match datatype {inp.datatype}") from None
    try:
        with np.errstate(over="ignore"):  # overflow is checked just below, as a 400
            array = np.array(values, dtype=dtype)
    except (OverflowError, ValueError):
        raise InvalidInput(f"input {inp.name!r}: a value is out of range for {inp.datatype}") from None
    # JSON numbers are finite: anything infinite here overflowed the datatype (3.5e38 as FP32)
    if dtype.kind == "f" and not np.isfinite(array).all():
        raise InvalidInput(f"input {inp.name!r}: a value is out of range for {inp.datatype}")
    return array


def _decode_input(inp: _InputJSON, blob: memoryview, offset: int) -> tuple[np.ndarray, int]:
    """One input's array, from its JSON `data` or from the binary blob at `offset`; returns the next offset."""
    if inp.datatype not in V2_TO_NUMPY:
        raise InvalidInput(f"input {inp.name!r}: unsupported datatype {inp.datatype!r}")
    count = element_count(inp.shape, inp.name)
    size = inp.parameters.get("binary_data_size")
    if size is None:
        return _array_from_json(inp, count), offset
    if type(size) is not int or size < 0 or offset + size > len(blob):
        raise InvalidInput(f"input {inp.name!r}: binary_data_size {size} exceeds the binary data sent")
    raw = blob[offset : offset + size]
    if inp.datatype == "BYTES":
        return bytes_from_binary(raw, count, inp.name), offset + size
    dtype = V2_TO_NUMPY[inp.datatype]
    if size != count * dtype.itemsize:
        raise InvalidInput(
            f"input {inp.name!r}: {size} bytes given, shape {inp.shape} of {inp.datatype} needs {count * dtype.itemsize}"
        )
    # A read-only view of the body, not a copy: runtimes read their inputs, and a large tensor
    # (an image batch) would otherwise be copied once more on the event loop.
    array = np.frombuffer(raw, dtype=dtype)
    if dtype.kind == "f":
        require_finite(array, inp.name, inp.datatype)
    return array, offset + size


def decode_infer(body: bytes, header_length: int | None, request_id: str) -> DecodedInfer:
    """Parse a v2 inference body (JSON, or JSON header + binary blobs)."""
    if header_length is not None:
        if header_length < 0 or header_length > len(body):
            raise InvalidInput("Inference-Header-Content-Length is larger than the body")
        head, blob = body[:header_length], memoryview(body)[header_length:]
    else:
        head, blob = body, memoryview(b"")
    try:
        parsed = _request_decoder.decode(head)
    except JSON_DECODE_ERRORS as exc:
        raise InvalidInput(describe_decode_error(exc)) from None
    offset = 0
    tensors: list[Tensor] = []
    for inp in parsed.inputs:
        array, offset = _decode_input(inp, blob, offset)
        tensors.append(
            Tensor(
                name=inp.name, datatype=inp.datatype, shape=tuple(inp.shape), data=array.reshape(inp.shape)
            )
        )
    if offset != len(blob):
        raise InvalidInput(f"{len(blob) - offset} bytes of binary data are not claimed by any input")
    binary_default = bool(parsed.parameters.get("binary_data_output", False))
    binary_outputs: dict[str, bool] = {}
    names = None
    if parsed.outputs is not None:
        names = [o.name for o in parsed.outputs]
        for o in parsed.outputs:
            binary_outputs[o.name] = bool(o.parameters.get("binary_data", binary_default))
    request = TensorRequest(
        id=parsed.id or request_id, inputs=tensors, outputs=names, parameters=parsed.parameters
    )
    return DecodedInfer(request=request, binary_outputs=binary_outputs, binary_default=binary_default)


def binary_of(data: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        parts = []
        for v in data.reshape(-1):
            b = v if isinstance(v, bytes) else str(v).encode()
            parts.append(struct.pack("<I", len(b)))
            parts.append(b)
        return b"".join(parts)
    return np.ascontiguousarray(data).tobytes()


def _json_of(data: np.ndarray, datatype: str) -> list[Any]:
    flat = data.reshape(-1)
    if datatype == "BYTES":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
    if datatype == "FP16":
        flat = flat.astype(np.float32)
    return flat.tolist()


def encode_infer(
    response: TensorResponse, model: str, version: str | None, decoded: DecodedInfer
) -> tuple[bytes, int | None]:
    """Encode a v2 response; returns (body, json header length or None when all JSON)."""
    outputs_json: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for t in response.outputs:
        entry: dict[str, Any] = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        if decoded.binary_outputs.get(t.name, decoded.binary_default):
            blob = binary_of(t.data, t.datatype)
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = _json_of(t.data, t.datatype)
        outputs_json.append(entry)
    head: dict[str, Any] = {"model_name": model, "id": response.id, "outputs": outputs_json}
    if version is not None:
        head["model_version"] = version
    header = _encoder.encode(head)
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)
