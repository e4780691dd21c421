"""`queue.split_rows`: a large tensor request runs as slices, each taking its own turn in the fair
queue, so a quiet tenant's request is served between two slices of a flood request; the answer is
the same as unsplit."""

from __future__ import annotations

import asyncio

import numpy as np

from backends.base import Tensor, TensorRequest
from backends.demo_models.digits import digits_split
from policies.principal import Principal
from tests.gateway.test_stream_accounting import open_core

FLOOD = Principal(tenant="flood", key_id="k-flood")
QUIET = Principal(tenant="quiet", key_id="k-quiet")


def _yaml(model: str, split_rows: str) -> str:
    return f"""
state: {{url: "memory://"}}
tenants: {{flood: {{}}, quiet: {{}}}}
deployments:
  ort: {{backend: onnxruntime, model: {model}, queue: {{policy: vtc, max_concurrency: 1, split_rows: {split_rows}}}}}
models:
  digits: {{routes: [{{deployment: ort}}]}}
"""


def _request(x: np.ndarray, rid: str) -> TensorRequest:
    return TensorRequest(id=rid, inputs=[Tensor.from_array("input", x)])


async def test_slices_answer_as_the_whole_request(digits) -> None:  # noqa: ANN001
    x = digits_split()[1][:7]
    async with open_core(_yaml(str(digits.onnx_path), "null")) as whole_core:
        plan = whole_core.plan(FLOOD, "digits", None, None, {})
        whole, _ = await whole_core.infer(FLOOD, plan, _request(x, "w"))
    async with open_core(_yaml(str(digits.onnx_path), "2")) as core:
        plan = core.plan(FLOOD, "digits", None, None, {})
        sliced, _ = await core.infer(FLOOD, plan, _request(x, "s"))
        assert core.deployments["ort"].queue.stats().tenants["flood"].dispatched == 4  # 2+2+2+1 rows
    for a, b in zip(whole.outputs, sliced.outputs, strict=True):
        assert a.name == b.name and a.shape == b.shape == (7, *a.shape[1:])
        np.testing.assert_allclose(np.asarray(a.data), np.asarray(b.data), atol=1e-6)


async def test_a_quiet_request_goes_between_two_slices_of_a_large_one(digits) -> None:  # noqa: ANN001
    assert await _order(digits, split_rows="8") == ["quiet", "large"]
    # the same without slicing: the large request, once started, runs to its end first
    assert await _order(digits, split_rows="null") == ["large", "quiet"]


async def _order(digits, split_rows: str) -> list[str]:  # noqa: ANN001
    x = digits_split()[1]
    async with open_core(_yaml(str(digits.onnx_path), split_rows)) as core:
        plan = core.plan(FLOOD, "digits", None, None, {})
        queue = core.deployments["ort"].queue
        held = await queue.acquire("flood", 1)  # the one slot is busy: the large request waits
        done: list[str] = []

        async def send(principal: Principal, rows: np.ndarray, name: str) -> None:
            await core.infer(principal, plan, _request(rows, name))
            done.append(name)

        large = asyncio.create_task(send(FLOOD, x[:64], "large"))  # 8 slices of 8 rows
        await asyncio.sleep(0.01)
        queue.release(held, 1)  # the large request (its first slice) gets the slot...
        quiet = asyncio.create_task(send(QUIET, x[:1], "quiet"))  # ...and the quiet one queues behind it
        await asyncio.gather(large, quiet)
        return done
