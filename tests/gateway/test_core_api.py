"""The protocol-neutral core API, driven by a protocol adapter that is not HTTP.

`LineProtocol` is a test double of the gRPC servicers to come: its requests are plain dicts with
metadata (lower-cased names, as gRPC metadata arrives), its answers carry a status *name* instead
of an HTTP status. It uses only what any adapter uses (`Call`, `ModelRef`, and the core's
`serve_tensors`, `serve_generation`, `model_view`), never the router, the queue or admission, and
the whole tenant path (keys, visibility, limits, usage, access records) still applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from backends.base import ChatMessage, GenerateRequest, ModelMetadata, SamplingParams, Tensor, TensorRequest
from backends.demo_models.digits import digits_split
from backends.errors import InvalidInput
from fleetgate.errors import describe
from gateway.core.calls import Call, ModelRef
from gateway.core.results import GenerationInput
from gateway.core.service import GatewayCore
from gateway.wire.credentials import bearer_key
from tests.gateway.test_stream_accounting import model_dir, open_core  # noqa: F401 - fixture

#: how the double names outcomes, in the manner of gRPC status codes
STATUS_NAMES = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED"}


@dataclass
class Decoded:
    request: TensorRequest


class LineProtocol:
    """A minimal non-HTTP front end over the core API."""

    def __init__(self, core: GatewayCore) -> None:
        self.core = core
        self.calls: list[Call] = []

    def _call(self, metadata: Mapping[str, str]) -> Call:
        call = Call("v2", metadata, bearer_key(metadata))
        self.calls.append(call)
        return call

    def _fail(self, call: Call, exc: BaseException) -> dict[str, Any]:
        known = describe(exc)
        assert known is not None, f"an internal error reached the adapter: {exc!r}"
        call.done(known[0], known[1])
        return {"status": STATUS_NAMES.get(known[0], "UNAVAILABLE"), "message": known[2]}

    async def infer(self, metadata: Mapping[str, str], model: str, rows: Any) -> dict[str, Any]:
        call = self._call(metadata)

        async def load(meta: ModelMetadata) -> Decoded:
            array = np.asarray(rows, dtype=np.float32)
            if array.ndim != 2:
                raise InvalidInput("rows must be a matrix")
            return Decoded(
                TensorRequest(id=call.request_id, inputs=[Tensor.from_array(meta.inputs[0].name, array)])
            )

        try:
            outcome = await self.core.serve_tensors(call, ModelRef(model), load)
        except Exception as exc:  # noqa: BLE001 - answered in the double's own envelope
            return self._fail(call, exc)
        call.done(200)
        outputs = {t.name: t.data for t in outcome.response.outputs}
        return {"status": "OK", "outputs": outputs, "served_by": outcome.served.deployment.name}

    async def generate(
        self, metadata: Mapping[str, str], model: str, text: str, max_tokens: int
    ) -> dict[str, Any]:
        call = self._call(metadata)

        async def load() -> GenerationInput:
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            messages = [ChatMessage(role="user", content=text)]
            return GenerationInput(
                ModelRef(model),
                lambda: GenerateRequest(request_id=call.request_id, messages=messages, sampling=sampling),
            )

        try:
            started = await self.core.serve_generation(call, load)
            tokens: list[int] = []
            async for event in started.stream:
                tokens.extend(event.token_ids)
        except Exception as exc:  # noqa: BLE001
            return self._fail(call, exc)
        call.done(200)
        return {"status": "OK", "tokens": tokens}

    async def ready(self, metadata: Mapping[str, str], model: str) -> dict[str, Any]:
        call = self._call(metadata)
        try:
            view = await self.core.model_view(call, ModelRef(model))
        except Exception as exc:  # noqa: BLE001
            return self._fail(call, exc)
        call.done(200)
        return {"status": "OK", "ready": view.ready, "inputs": [s.name for s in view.metadata().inputs]}


def core_yaml(digits_onnx: str, llm_dir: Path) -> str:
    return f"""
state: {{url: "memory://"}}
tenants:
  acme: {{limits: {{requests_per_minute: 1}}}}
  other: {{models: [digits]}}
  beta: {{}}
deployments:
  ort: {{backend: onnxruntime, model: {digits_onnx}}}
  llm: {{backend: torch_llm, model: {llm_dir}, device: cpu, options: {{max_num_seqs: 2}}}}
models:
  digits: {{routes: [{{deployment: ort}}]}}
  tiny: {{routes: [{{deployment: llm}}]}}
"""


@pytest.mark.slow
async def test_a_non_http_adapter_gets_the_whole_tenant_path(digits, model_dir: Path) -> None:  # noqa: F811
    async with open_core(core_yaml(str(digits.onnx_path), model_dir)) as core:
        front = LineProtocol(core)
        _, acme_key = await core.keys.create("acme", None, None, "line")
        _, other_key = await core.keys.create("other", None, None, "line")
        _, beta_key = await core.keys.create("beta", None, None, "line")
        acme = {"authorization": f"Bearer {acme_key}"}

        assert (await front.infer({}, "digits", [[0.0] * 64]))["status"] == "UNAUTHENTICATED"
        assert (await front.infer({"x-api-key": "fg-wrong"}, "digits", [[0.0] * 64]))[
            "status"
        ] == "UNAUTHENTICATED"
        assert (await front.infer(acme, "nope", [[0.0] * 64]))["status"] == "NOT_FOUND"
        # a model outside the tenant's allow-list looks exactly like one that does not exist
        other = {"x-api-key": other_key}
        assert (await front.ready(other, "tiny"))["status"] == "NOT_FOUND"

        ready = await front.ready(acme, "digits")
        assert ready == {"status": "OK", "ready": True, "inputs": ["input"]}

        x_test = digits_split()[1][:2]
        answer = await front.infer(acme, "digits", x_test)
        assert answer["status"] == "OK" and answer["served_by"] == "ort"
        probabilities = answer["outputs"]["probabilities"]
        assert probabilities.shape == (2, 10) and np.allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)

        # refused while decoding, before admission: costs no request of the tenant's limit
        assert (await front.infer(acme, "digits", [1.0, 2.0]))["status"] == "INVALID_ARGUMENT"
        # the tenant's limit (1 request per minute) applies on this front end too
        refused = await front.generate(acme, "tiny", "hello", 4)
        assert refused["status"] == "RESOURCE_EXHAUSTED", refused

        assert (await front.generate(other, "digits", "hello", 4))["status"] == "INVALID_ARGUMENT"
        generated = await front.generate({"x-api-key": beta_key}, "tiny", "hello", 4)
        assert generated["status"] == "OK" and len(generated["tokens"]) == 4

        usage = {(r.model, r.requests) for r in await core.admission.usage("acme") if len(r.period) == 10}
        assert usage == {("digits", 1)}
        beta_usage = [r for r in await core.admission.usage("beta") if len(r.period) == 10]
        assert [(r.model, r.requests) for r in beta_usage] == [("tiny", 1)] and beta_usage[0].tokens > 4

    # every call was recorded with its tenant and model, as HTTP calls are
    tenants = [(c.tenant, c.model) for c in front.calls]
    assert ("acme", "digits") in tenants and ("other", "tiny") in tenants and ("beta", "tiny") in tenants
