"""The v2 codec's element checks and binary decoding (the per-request hot path)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from backends.errors import InvalidInput
from gateway.wire.v2_codec import decode_infer


def _json_body(datatype: str, data: list) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "x", "shape": [len(data)], "datatype": datatype, "data": data}]}
    ).encode()


@pytest.mark.parametrize(
    ("datatype", "data"),
    [("FP32", [1.0, True]), ("INT64", [1, 2.5]), ("INT32", [1, False]), ("BOOL", [True, 1]), ("FP32", ["1"])],
)
def test_json_elements_of_the_wrong_type_are_refused(datatype: str, data: list) -> None:
    with pytest.raises(InvalidInput, match="does not match datatype"):
        decode_infer(_json_body(datatype, data), None, "r")


@pytest.mark.parametrize(
    ("datatype", "data", "dtype"),
    [("FP32", [1, 2.5], np.float32), ("INT64", [1, -2], np.int64), ("BOOL", [True, False], np.bool_)],
)
def test_json_elements_decode_to_the_datatype(datatype: str, data: list, dtype: type) -> None:
    tensor = decode_infer(_json_body(datatype, data), None, "r").request.inputs[0]
    assert tensor.data.dtype == dtype
    np.testing.assert_array_equal(tensor.data, np.array(data, dtype))


def test_out_of_range_integers_are_refused() -> None:
    with pytest.raises(InvalidInput, match="out of range"):
        decode_infer(_json_body("INT8", [1, 300]), None, "r")


def test_binary_inputs_are_read_only_views_of_the_body() -> None:
    rows = np.arange(12, dtype=np.float32).reshape(3, 4)
    header = json.dumps(
        {
            "inputs": [
                {"name": "x", "shape": [3, 4], "datatype": "FP32", "parameters": {"binary_data_size": 48}}
            ]
        }
    ).encode()
    tensor = decode_infer(header + rows.tobytes(), len(header), "r").request.inputs[0]
    np.testing.assert_array_equal(tensor.data, rows)
    assert not tensor.data.flags.writeable  # no copy was made; runtimes only read their inputs
