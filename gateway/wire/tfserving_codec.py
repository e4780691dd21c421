"""TF Serving REST bodies <-> internal tensors.

Row form: `{"instances": [...]}` -> `{"predictions": [...]}`; columnar form: `{"inputs": ...}` ->
`{"outputs": ...}`. Binary strings travel as `{"b64": "..."}`. JSON carries no dtypes, so values are
typed from the model's metadata, and a value of the wrong kind (a string for a float input) is a 400.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import msgspec
import numpy as np

from backends.base import V2_TO_NUMPY, ModelMetadata, Tensor, TensorRequest, TensorResponse, TensorSpec
from backends.errors import InvalidInput
from backends.runtime.json_errors import JSON_DECODE_ERRORS, describe_decode_error

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()

V2_TO_TF = {
    "BOOL": "DT_BOOL",
    "UINT8": "DT_UINT8",
    "UINT16": "DT_UINT16",
    "UINT32": "DT_UINT32",
    "UINT64": "DT_UINT64",
    "INT8": "DT_INT8",
    "INT16": "DT_INT16",
    "INT32": "DT_INT32",
    "INT64": "DT_INT64",
    "FP16": "DT_HALF",
    "FP32": "DT_FLOAT",
    "FP64": "DT_DOUBLE",
    "BYTES": "DT_STRING",
}


class PredictRequest(msgspec.Struct):
    request: TensorRequest
    #: answer in row form (predictions) or columnar form (outputs)
    row_form: bool


def _unb64(value: Any, name: str) -> Any:
    if isinstance(value, dict):
        if set(value) != {"b64"} or not isinstance(value["b64"], str):
            raise InvalidInput(f'input {name!r}: an object value must be {{"b64": "..."}}')
        try:
            return base64.b64decode(value["b64"], validate=True)
        except binascii.Error:
            raise InvalidInput(f"input {name!r}: invalid base64") from None
    if isinstance(value, list):
        return [_unb64(v, name) for v in value]
    if isinstance(value, str):
        return value.encode()
    return value


def to_array(value: Any, spec: TensorSpec) -> np.ndarray:
    """Type a JSON value by the model's datatype; refuse values of the wrong kind or ragged lists."""
    name = spec.name
    if spec.datatype == "BYTES":
        raw = _unb64(value, name)
        try:
            array = np.array(raw, dtype=object)
        except ValueError:
            raise InvalidInput(f"input {name!r}: ragged nested lists") from None
        if not all(isinstance(v, bytes) for v in array.reshape(-1)):
            raise InvalidInput(f"input {name!r}: expected strings for a DT_STRING input")
        return array
    try:
        probe = np.asarray(value)
    except ValueError:
        raise InvalidInput(f"input {name!r}: ragged nested lists") from None
    allowed = "b" if spec.datatype == "BOOL" else ("biuf" if spec.datatype.startswith("FP") else "biu")
    if probe.dtype.kind not in allowed or (spec.datatype != "BOOL" and probe.dtype.kind == "b"):
        raise InvalidInput(f"input {name!r}: values do not match the model's {V2_TO_TF[spec.datatype]}")
    try:
        return probe.astype(V2_TO_NUMPY[spec.datatype])
    except (TypeError, ValueError, OverflowError):
        raise InvalidInput(f"input {name!r}: values do not fit {V2_TO_TF[spec.datatype]}") from None


def _rows_to_columns(instances: list[Any], meta: ModelMetadata) -> dict[str, Any]:
    names = [s.name for s in meta.inputs]
    if not instances:
        raise InvalidInput("`instances` is empty")
    if all(isinstance(i, dict) and "b64" not in i for i in instances):
        columns: dict[str, list[Any]] = {}
        for row, inst in enumerate(instances):
            if set(inst) != set(names):
                raise InvalidInput(
                    f"instance {row}: names {sorted(inst)} do not match the model's inputs {names}"
                )
            for k, v in inst.items():
                columns.setdefault(k, []).append(v)
        return columns
    if len(names) != 1:
        raise InvalidInput(f"the model has inputs {names}: each instance must be an object naming them")
    return {names[0]: instances}


def decode_predict(body: bytes, meta: ModelMetadata, request_id: str) -> PredictRequest:
    try:
        payload = _decoder.decode(body)
    except JSON_DECODE_ERRORS as exc:
        raise InvalidInput(describe_decode_error(exc)) from None
    if not isinstance(payload, dict):
        raise InvalidInput("the body must be a JSON object with `instances` or `inputs`")
    has_rows, has_cols = "instances" in payload, "inputs" in payload
    if has_rows == has_cols:
        raise InvalidInput(
            "the body must have exactly one of `instances` (row form) or `inputs` (columnar form)"
        )
    specs = {s.name: s for s in meta.inputs}
    if has_rows:
        if not isinstance(payload["instances"], list):
            raise InvalidInput("`instances` must be a list")
        columns = _rows_to_columns(payload["instances"], meta)
    elif isinstance(payload["inputs"], dict):
        columns = payload["inputs"]
    elif len(specs) == 1:
        columns = {next(iter(specs)): payload["inputs"]}
    else:
        raise InvalidInput(f"the model has inputs {sorted(specs)}: `inputs` must be an object naming them")
    tensors = []
    for name, value in columns.items():
        spec = specs.get(name)
        if spec is None:
            raise InvalidInput(f"unknown input {name!r}; the model's inputs are {sorted(specs)}")
        array = to_array(value, spec)
        tensors.append(Tensor(name=name, datatype=spec.datatype, shape=tuple(array.shape), data=array))
    return PredictRequest(request=TensorRequest(id=request_id, inputs=tensors), row_form=has_rows)


def _jsonable(array: np.ndarray) -> Any:
    if array.dtype == object:
        return (
            np.vectorize(
                lambda v: {"b64": base64.b64encode(v).decode()} if isinstance(v, bytes) else v,
                otypes=[object],
            )(array).tolist()
            if array.size
            else array.tolist()
        )
    if array.dtype == np.float16:
        array = array.astype(np.float32)
    return array.tolist()


def encode_predict(response: TensorResponse, row_form: bool) -> bytes:
    outs = {t.name: t.data for t in response.outputs}
    if row_form:
        if len(outs) == 1:
            return _encoder.encode({"predictions": _jsonable(next(iter(outs.values())))})
        rows = min(int(a.shape[0]) if a.ndim else 1 for a in outs.values())
        preds = [
            {k: _jsonable(v[i]) if v.ndim else _jsonable(v) for k, v in outs.items()} for i in range(rows)
        ]
        return _encoder.encode({"predictions": preds})
    if len(outs) == 1:
        return _encoder.encode({"outputs": _jsonable(next(iter(outs.values())))})
    return _encoder.encode({"outputs": {k: _jsonable(v) for k, v in outs.items()}})


def signature_def(meta: ModelMetadata) -> dict[str, Any]:
    """The model's metadata in TF Serving's GetModelMetadata JSON shape."""

    def tensor_info(s: TensorSpec) -> dict[str, Any]:
        return {
            "dtype": V2_TO_TF.get(s.datatype, "DT_INVALID"),
            "tensor_shape": {"dim": [{"size": str(d), "name": ""} for d in s.shape], "unknown_rank": False},
            "name": s.name,
        }

    return {
        "signature_def": {
            "serving_default": {
                "inputs": {s.name: tensor_info(s) for s in meta.inputs},
                "outputs": {s.name: tensor_info(s) for s in meta.outputs},
                "method_name": "tensorflow/serving/predict",
            }
        }
    }
