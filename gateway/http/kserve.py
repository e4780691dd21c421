"""Open Inference Protocol v2 (KServe v2 / Triton HTTP): health, metadata, readiness, infer."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response, get, post
from litestar.types import ASGIApp

from backends.base import ModelMetadata
from fleetgate.errors import GatewayError
from gateway.core.calls import Call, ModelRef
from gateway.core.service import GatewayCore
from gateway.http.api_docs import KEYED, TENSOR_ERRORS, InferOperation, V2InferResponse, answers
from gateway.http.requests import (
    RawResponse,
    answer_json,
    http_failure,
    json_response,
    protocol_opt,
    read_body,
)
from gateway.wire.v2_codec import SERVER_NAME, SERVER_VERSION, DecodedInfer, decode_infer, encode_infer

V2 = protocol_opt("v2")
#: the body is read raw, after the room step (docs/decisions/0001-raw-tensor-bodies.md); documented here
_INFER: dict[str, Any] = {
    "operation_class": InferOperation,
    "responses": answers(V2InferResponse, TENSOR_ERRORS),
    "security": KEYED,
}
#: the protocol extensions served (say only what is served: no repository routes over HTTP)
EXTENSIONS = ["binary_tensor_data"]


@get("/v2", sync_to_thread=False)
def server_metadata() -> Response[bytes]:
    return json_response({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})


@get("/v2/health/live", sync_to_thread=False)
def live() -> Response[bytes]:
    return json_response({"live": True})


@get("/v2/health/ready", sync_to_thread=False)
def ready(core: GatewayCore) -> Response[bytes]:
    ok = core.ready()
    return json_response({"ready": ok}, 200 if ok else 503)


async def _metadata(core: GatewayCore, call: Call, model: ModelRef) -> Response[bytes]:
    async def work() -> tuple[dict[str, Any], int]:
        view = await core.model_view(call, model)
        meta = view.metadata()
        dep = view.deployment
        if dep is not None:  # None: a graph, served by its steps' deployments
            call.served_by(dep.name, dep.spec.backend, dep.device)
        body = {
            "name": view.name,
            "versions": view.versions or ["1"],
            "platform": meta.platform,
            "inputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in meta.inputs],
            "outputs": [
                {"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in meta.outputs
            ],
        }
        return body, 200

    return await answer_json(call, work)


@get("/v2/models/{model:str}", opt=V2, responses=TENSOR_ERRORS, security=KEYED)
async def model_metadata(core: GatewayCore, call: Call, model: str) -> Response[bytes]:
    return await _metadata(core, call, ModelRef(model))


@get("/v2/models/{model:str}/versions/{version:str}", opt=V2, responses=TENSOR_ERRORS, security=KEYED)
async def model_version_metadata(core: GatewayCore, call: Call, model: str, version: str) -> Response[bytes]:
    return await _metadata(core, call, ModelRef(model, version))


async def _ready(core: GatewayCore, call: Call, model: ModelRef) -> Response[bytes]:
    async def work() -> tuple[dict[str, Any], int]:
        view = await core.model_view(call, model)
        return {"name": model.name, "ready": view.ready}, 200 if view.ready else 503

    return await answer_json(call, work)


@get("/v2/models/{model:str}/ready", opt=V2, responses=TENSOR_ERRORS, security=KEYED)
async def model_ready(core: GatewayCore, call: Call, model: str) -> Response[bytes]:
    return await _ready(core, call, ModelRef(model))


@get("/v2/models/{model:str}/versions/{version:str}/ready", opt=V2, responses=TENSOR_ERRORS, security=KEYED)
async def model_version_ready(core: GatewayCore, call: Call, model: str, version: str) -> Response[bytes]:
    return await _ready(core, call, ModelRef(model, version))


async def infer_model(request: Request, core: GatewayCore, call: Call, model: ModelRef) -> ASGIApp:
    """v2 `/infer`: Litestar's route calls this."""

    async def load(meta: ModelMetadata) -> DecodedInfer:
        body = await read_body(request, core.config.server.max_body_bytes, headers=call.headers)
        header_len = _parse_header_length(call.headers.get("inference-header-content-length"))
        return decode_infer(body, header_len, call.request_id)

    try:
        outcome = await core.serve_tensors(call, model, load)
        plan = outcome.served.plan
        payload, json_len = encode_infer(outcome.response, model.name, plan.version, outcome.decoded)
        out_headers = outcome.served.response_headers(call)
        if json_len is not None:
            out_headers["Inference-Header-Content-Length"] = str(json_len)
            media = "application/octet-stream"
        else:
            media = "application/json"
        call.done(200)
        return RawResponse(payload, 200, media, out_headers)
    except Exception as exc:  # noqa: BLE001
        return http_failure(call, exc)


def _parse_header_length(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise GatewayError(400, "invalid_header", "Inference-Header-Content-Length is not a number") from None


@post("/v2/models/{model:str}/infer", status_code=200, opt=V2, **_INFER)
async def infer(request: Request, core: GatewayCore, call: Call, model: str) -> ASGIApp:
    return await infer_model(request, core, call, ModelRef(model))


@post("/v2/models/{model:str}/versions/{version:str}/infer", status_code=200, opt=V2, **_INFER)
async def infer_version(request: Request, core: GatewayCore, call: Call, model: str, version: str) -> ASGIApp:
    return await infer_model(request, core, call, ModelRef(model, version))


ROUTES = [
    server_metadata,
    live,
    ready,
    model_metadata,
    model_version_metadata,
    model_ready,
    model_version_ready,
    infer,
    infer_version,
]
