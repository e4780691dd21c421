"""Per-request queue hints: priority inside a tenant's queue and a queue deadline, from headers."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from backends.base import Tensor, TensorRequest
from backends.demo_models.digits import digits_split
from backends.errors import InvalidInput
from gateway.core.queue.hints import NO_HINTS, QueueHints, queue_hints
from policies.fair_queue.errors import QueueDeadlineExceeded
from policies.principal import Principal
from tests.gateway.test_stream_accounting import open_core

ACME = Principal(tenant="acme", key_id="k-acme")


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, NO_HINTS),
        ({"x-fleetgate-priority": "interactive"}, QueueHints(priority=1)),
        ({"x-fleetgate-priority": " Batch "}, QueueHints(priority=-1)),
        ({"x-fleetgate-priority": "-7"}, QueueHints(priority=-7)),
        ({"x-fleetgate-deadline-ms": "250"}, QueueHints(timeout_s=0.25)),
        ({"x-fleetgate-priority": "5", "x-fleetgate-deadline-ms": "1.5"}, QueueHints(5, 0.0015)),
    ],
)
def test_headers_parse(headers: dict[str, str], expected: QueueHints) -> None:
    assert queue_hints(headers) == expected


@pytest.mark.parametrize(
    ("headers", "needle"),
    [
        ({"x-fleetgate-priority": "urgent"}, "x-fleetgate-priority must be"),
        ({"x-fleetgate-priority": "101"}, "-100..100"),
        ({"x-fleetgate-deadline-ms": "0"}, "x-fleetgate-deadline-ms must be a positive"),
        ({"x-fleetgate-deadline-ms": "nan"}, "positive number"),
        ({"x-fleetgate-deadline-ms": "1e12"}, "up to 86400000"),
    ],
)
def test_bad_headers_are_the_callers_mistake(headers: dict[str, str], needle: str) -> None:
    with pytest.raises(InvalidInput, match=needle):
        queue_hints(headers)


@pytest.fixture
def rows() -> np.ndarray:
    _, x_test, _, _ = digits_split()
    return x_test[:2]


def test_bad_hint_answers_400_in_each_protocol(gateway, rows) -> None:
    bad = {**gateway.headers(), "x-fleetgate-deadline-ms": "-5"}
    v2 = httpx.post(
        f"{gateway.url}/v2/models/digits/infer",
        json={
            "inputs": [
                {
                    "name": "input",
                    "shape": list(rows.shape),
                    "datatype": "FP32",
                    "data": rows.ravel().tolist(),
                }
            ]
        },
        headers=bad,
    )
    assert v2.status_code == 400 and "x-fleetgate-deadline-ms" in v2.json()["error"]
    tfs = httpx.post(
        f"{gateway.url}/v1/models/digits:predict", json={"instances": rows.tolist()}, headers=bad
    )
    assert tfs.status_code == 400 and "x-fleetgate-deadline-ms" in tfs.json()["error"]


def digits_yaml(model: str) -> str:
    return f"""
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments:
  ort: {{backend: onnxruntime, model: {model}, queue: {{max_concurrency: 1}}}}
models:
  digits: {{routes: [{{deployment: ort}}]}}
"""


def digits_request(value: float) -> TensorRequest:
    x = np.full((1, 64), value, np.float32)
    return TensorRequest(id=f"r{value}", inputs=[Tensor.from_array("input", x)])


async def test_deadline_header_drops_a_queued_request_before_the_backend(digits) -> None:
    async with open_core(digits_yaml(str(digits.onnx_path))) as core:
        queue = core.deployments["ort"].queue
        held = await queue.acquire("acme", 1)  # the deployment's only slot is busy
        plan = core.plan(ACME, "digits", None, None, {})
        with pytest.raises(QueueDeadlineExceeded):
            await core.infer(ACME, plan, digits_request(1.0), QueueHints(timeout_s=0.05))
        queue.release(held, 1)
        response, _ = await core.infer(ACME, plan, digits_request(1.0), QueueHints(timeout_s=0.05))
        assert response.outputs


async def test_priority_orders_requests_inside_a_tenant(digits) -> None:
    async with open_core(digits_yaml(str(digits.onnx_path))) as core:
        queue = core.deployments["ort"].queue
        held = await queue.acquire("acme", 1)
        plan = core.plan(ACME, "digits", None, None, {})
        finished: list[str] = []

        async def send(name: str, priority: int) -> None:
            await core.infer(ACME, plan, digits_request(float(priority)), QueueHints(priority=priority))
            finished.append(name)

        tasks = [asyncio.create_task(send("batch", -1))]
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(send("normal", 0)))
        await asyncio.sleep(0.01)
        tasks.append(asyncio.create_task(send("interactive", 1)))
        await asyncio.sleep(0.01)
        queue.release(held, 1)
        await asyncio.gather(*tasks)
        assert finished == ["interactive", "normal", "batch"]
