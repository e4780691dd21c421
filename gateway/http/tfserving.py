"""TF Serving REST: predict, model status and metadata under /v1/models/.

Path rule where TF Serving and OpenAI meet: `GET /v1/models/{m}` answers ONE body that is both an
OpenAI Model object (`id`, `object`, `created`, `owned_by`) and a TF Serving GetModelStatus response
(`model_version_status`), so the openai SDK's `models.retrieve()` and TF Serving clients both work.
Errors on that shared path use the OpenAI envelope (`{"error": {"message": ...}}`). Every other
`/v1/models/...` path (versions, labels, metadata, `:predict`) is TF Serving's alone and answers
errors as `{"error": "..."}`.
"""

from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response, get, post

from backends.base import ModelMetadata
from backends.errors import InvalidInput, ModelNotFound
from gateway.core.calls import Call, ModelRef
from gateway.core.service import GatewayCore
from gateway.http.api_docs import (
    KEYED,
    OPENAI_ERRORS,
    TENSOR_ERRORS,
    PredictOperation,
    PredictResponse,
    answers,
)
from gateway.http.requests import answer_json, http_failure, protocol_opt, read_body
from gateway.wire.tfserving_codec import PredictRequest, decode_predict, encode_predict, signature_def

TFS = protocol_opt("tfserving")
#: `GET /v1/models/{m}` is shared with OpenAI's models.retrieve(): errors use the OpenAI envelope
SHARED = protocol_opt("openai")
VERBS = ("predict", "classify", "regress")
_STARTED = int(time.time())
#: the body is read raw, after the room step (docs/decisions/0001-raw-tensor-bodies.md); documented here
_PREDICT: dict[str, Any] = {
    "operation_class": PredictOperation,
    "responses": answers(PredictResponse, TENSOR_ERRORS),
    "security": KEYED,
}


def _split_verb(segment: str) -> tuple[str, str]:
    """`digits:predict` -> ("digits", "predict"); a missing or unknown verb is a 404-like 400."""
    name, sep, verb = segment.rpartition(":")
    if not sep or verb not in VERBS:
        raise ModelNotFound(f"no such method: {segment!r} (expected <model>:predict)")
    if verb != "predict":
        raise InvalidInput(f"`:{verb}` is not supported; use `:predict`")
    return name, verb


async def predict_route(
    request: Request, core: GatewayCore, call: Call, model: str, segment: str, slot: str
) -> Response[bytes]:
    """`segment` is the last path segment (`name:predict`); its name fills `slot` (model/version/label).
    Litestar's route calls this."""
    call.model = model

    async def load(meta: ModelMetadata) -> PredictRequest:
        body = await read_body(request, core.config.server.max_body_bytes, headers=call.headers)
        return decode_predict(body, meta, call.request_id)

    try:
        name, _ = _split_verb(segment)
        ref = {
            "model": ModelRef(name),
            "version": ModelRef(model, version=name),
            "label": ModelRef(model, label=name),
        }[slot]
        call.model = ref.name
        outcome = await core.serve_tensors(call, ref, load)
        call.done(200)
        return Response(
            content=encode_predict(outcome.response, outcome.decoded.row_form),
            media_type="application/json",
            headers=outcome.served.response_headers(call),
        )
    except Exception as exc:  # noqa: BLE001 - answered in the protocol's envelope
        return http_failure(call, exc)


@post("/v1/models/{segment:str}", status_code=200, opt=TFS, **_PREDICT)
async def predict(request: Request, core: GatewayCore, call: Call, segment: str) -> Response[bytes]:
    return await predict_route(request, core, call, "", segment, "model")


@post("/v1/models/{model:str}/versions/{segment:str}", status_code=200, opt=TFS, **_PREDICT)
async def predict_version(
    request: Request, core: GatewayCore, call: Call, model: str, segment: str
) -> Response[bytes]:
    return await predict_route(request, core, call, model, segment, "version")


@post("/v1/models/{model:str}/labels/{segment:str}", status_code=200, opt=TFS, **_PREDICT)
async def predict_label(
    request: Request, core: GatewayCore, call: Call, model: str, segment: str
) -> Response[bytes]:
    return await predict_route(request, core, call, model, segment, "label")


async def _status(core: GatewayCore, call: Call, model: ModelRef) -> Response[bytes]:
    async def work() -> tuple[dict[str, Any], int]:
        view = await core.model_view(call, model)
        states = core.version_states(model.name, view.version)
        body: dict[str, Any] = {
            "model_version_status": [
                {
                    "version": version or "1",
                    "state": "AVAILABLE" if ok else "UNAVAILABLE",
                    "status": {"error_code": "OK", "error_message": ""},
                }
                for version, ok in states
            ]
        }
        if call.protocol == "openai":
            # One body, two readers: the OpenAI Model object rides along (see the module docstring).
            body.update({"id": model.name, "object": "model", "created": _STARTED, "owned_by": call.tenant})
        return body, 200

    return await answer_json(call, work)


@get("/v1/models/{model:str}", opt=SHARED, responses=OPENAI_ERRORS, security=KEYED)
async def model_status(core: GatewayCore, call: Call, model: str) -> Response[bytes]:
    return await _status(core, call, ModelRef(model))


@get("/v1/models/{model:str}/versions/{version:str}", opt=TFS, responses=TENSOR_ERRORS, security=KEYED)
async def model_version_status(core: GatewayCore, call: Call, model: str, version: str) -> Response[bytes]:
    return await _status(core, call, ModelRef(model, version=version))


@get("/v1/models/{model:str}/labels/{label:str}", opt=TFS, responses=TENSOR_ERRORS, security=KEYED)
async def model_label_status(core: GatewayCore, call: Call, model: str, label: str) -> Response[bytes]:
    return await _status(core, call, ModelRef(model, label=label))


async def _metadata(core: GatewayCore, call: Call, model: ModelRef) -> Response[bytes]:
    async def work() -> tuple[dict[str, Any], int]:
        view = await core.model_view(call, model)
        body = {
            "model_spec": {"name": model.name, "signature_name": "", "version": view.version or "1"},
            "metadata": {"signature_def": signature_def(view.metadata())},
        }
        return body, 200

    return await answer_json(call, work)


@get("/v1/models/{model:str}/metadata", opt=TFS, responses=TENSOR_ERRORS, security=KEYED)
async def model_metadata(core: GatewayCore, call: Call, model: str) -> Response[bytes]:
    return await _metadata(core, call, ModelRef(model))


@get("/v1/models/{model:str}/versions/{version:str}/metadata", opt=TFS, responses=TENSOR_ERRORS, security=KEYED)
async def model_version_metadata(core: GatewayCore, call: Call, model: str, version: str) -> Response[bytes]:
    return await _metadata(core, call, ModelRef(model, version=version))


@get("/v1/models/{model:str}/labels/{label:str}/metadata", opt=TFS, responses=TENSOR_ERRORS, security=KEYED)
async def model_label_metadata(core: GatewayCore, call: Call, model: str, label: str) -> Response[bytes]:
    return await _metadata(core, call, ModelRef(model, label=label))


ROUTES = [
    predict,
    predict_version,
    predict_label,
    model_status,
    model_version_status,
    model_label_status,
    model_metadata,
    model_version_metadata,
    model_label_metadata,
]
