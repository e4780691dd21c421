"""Open Inference Protocol v2 over gRPC: ModelInferRequest <-> TensorRequest, TensorResponse -> ModelInferResponse.

Inputs arrive either typed (`contents`, one repeated field per datatype family) or raw
(`raw_input_contents`, one little-endian buffer per input, what `tritonclient.grpc` sends by default;
BYTES elements carry a 4-byte length prefix each). Every input is checked before anything runs: a
known datatype, a sane shape, exactly the bytes or values the shape needs, values in range.
Outputs are answered raw, as Triton answers them, which every v2 gRPC client reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from backends.base import V2_TO_NUMPY, Tensor, TensorRequest, TensorResponse
from backends.errors import InvalidInput
from backends.runtime.validation import require_finite
from gateway.wire.v2_codec import binary_of, bytes_from_binary, element_count

#: typed contents field per datatype (FP16 has none in the protocol: it travels raw only)
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


@dataclass
class DecodedModelInfer:
    """A decoded ModelInferRequest: the internal request, and the client's own id to echo."""

    request: TensorRequest
    client_id: str


def _typed(inp: Any, count: int) -> np.ndarray:
    field = _CONTENTS_FIELD.get(inp.datatype)
    if field is None:
        raise InvalidInput(f"input {inp.name!r}: {inp.datatype} data must be sent as raw_input_contents")
    values = getattr(inp.contents, field)
    if len(values) != count:
        raise InvalidInput(
            f"input {inp.name!r}: {len(values)} values given, shape {list(inp.shape)} needs {count}"
        )
    if inp.datatype == "BYTES":
        return np.array(list(values), dtype=object)
    dtype = V2_TO_NUMPY[inp.datatype]
    wide = np.array(values)  # int64 / uint64 / float64 / bool: every value the field can hold
    array = wide.astype(dtype)
    if dtype.kind in "iu" and count and not np.array_equal(array.astype(wide.dtype), wide):
        raise InvalidInput(f"input {inp.name!r}: a value is out of range for {inp.datatype}")
    if dtype.kind == "f":
        require_finite(wide, inp.name, inp.datatype)
        if not np.isfinite(array).all():  # finite as sent, infinite once narrowed (3.5e38 as FP32)
            raise InvalidInput(f"input {inp.name!r}: a value is out of range for {inp.datatype}")
    return array


def _raw(inp: Any, raw: bytes, count: int) -> np.ndarray:
    if inp.datatype == "BYTES":
        return bytes_from_binary(memoryview(raw), count, inp.name)
    dtype = V2_TO_NUMPY[inp.datatype]
    if len(raw) != count * dtype.itemsize:
        raise InvalidInput(
            f"input {inp.name!r}: raw contents of {len(raw)} bytes, shape {list(inp.shape)} of "
            f"{inp.datatype} needs {count * dtype.itemsize}"
        )
    array = np.frombuffer(raw, dtype=dtype)
    if dtype.kind == "f":
        require_finite(array, inp.name, inp.datatype)
    return array


def decode_model_infer(message: Any, request_id: str) -> DecodedModelInfer:
    """The internal request of a ModelInferRequest (raises InvalidInput naming the input)."""
    raw_contents = list(message.raw_input_contents)
    if raw_contents and len(raw_contents) != len(message.inputs):
        raise InvalidInput(
            f"raw_input_contents has {len(raw_contents)} entries for {len(message.inputs)} inputs"
        )
    if not message.inputs:
        raise InvalidInput("the request has no inputs")
    tensors: list[Tensor] = []
    seen: set[str] = set()
    for index, inp in enumerate(message.inputs):
        if inp.name in seen:
            raise InvalidInput(f"input {inp.name!r} is given twice")
        seen.add(inp.name)
        if inp.datatype not in V2_TO_NUMPY:
            raise InvalidInput(f"input {inp.name!r}: unsupported datatype {inp.datatype!r}")
        shape = list(inp.shape)
        count = element_count(shape, inp.name)
        if raw_contents:
            if inp.HasField("contents"):
                raise InvalidInput(f"input {inp.name!r}: give raw_input_contents or contents, not both")
            flat = _raw(inp, raw_contents[index], count)
        else:
            flat = _typed(inp, count)
        tensors.append(
            Tensor(name=inp.name, datatype=inp.datatype, shape=tuple(shape), data=flat.reshape(shape))
        )
    outputs = [o.name for o in message.outputs] or None
    return DecodedModelInfer(TensorRequest(id=request_id, inputs=tensors, outputs=outputs), message.id)


def encode_model_infer(
    pb: Any, response: TensorResponse, model: str, version: str | None, client_id: str
) -> Any:
    """A ModelInferResponse with every output raw (`pb` is the generated service_pb2 module)."""
    answer = pb.ModelInferResponse(model_name=model, model_version=version or "", id=client_id)
    for t in response.outputs:
        answer.outputs.append(
            pb.ModelInferResponse.InferOutputTensor(name=t.name, datatype=t.datatype, shape=list(t.shape))
        )
        answer.raw_output_contents.append(binary_of(np.asarray(t.data), t.datatype))
    return answer
