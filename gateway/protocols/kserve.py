"""Open Inference Protocol v2 (KServe v2 / Triton HTTP): health, metadata, readiness, infer."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.types import ASGIApp

from gateway.core import GatewayCore
from gateway.deadline import Deadline
from gateway.errors import GatewayError
from gateway.http import Call, RawResponse, lower_headers, read_body
from gateway.protocols.v2_codec import decode_infer, encode_infer
from gateway.queue_hints import queue_hints

_encoder = msgspec.json.Encoder()
SERVER_NAME = "fleetgate"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["binary_tensor_data", "model_repository"]


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(
        content=_encoder.encode(payload), status_code=status, media_type="application/json", headers=headers
    )


def _core(request: Request) -> GatewayCore:
    return request.app.state.core


@get("/v2", sync_to_thread=False)
def server_metadata() -> Response[bytes]:
    return _json({"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS})


@get("/v2/health/live", sync_to_thread=False)
def live() -> Response[bytes]:
    return _json({"live": True})


@get("/v2/health/ready", sync_to_thread=False)
def ready(request: Request) -> Response[bytes]:
    ok = _core(request).ready()
    return _json({"ready": ok}, 200 if ok else 503)


async def _metadata(request: Request, model: str, version: str | None) -> Response[bytes]:
    headers = lower_headers(request)
    call = Call("v2", headers)
    call.model = model
    try:
        core = _core(request)
        principal = await core.authenticate(headers)
        call.tenant = principal.tenant
        plan = core.plan(principal, model, version, None, headers)
        dep = core.deployments[plan.primary]
        meta = dep.backend.metadata()
        body = {
            "name": model,
            "versions": core.router.versions(model) or ["1"],
            "platform": meta.platform,
            "inputs": [{"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in meta.inputs],
            "outputs": [
                {"name": s.name, "datatype": s.datatype, "shape": list(s.shape)} for s in meta.outputs
            ],
        }
        call.served_by(dep.name, dep.spec.backend, dep.device)
        call.done(200)
        return _json(body)
    except Exception as exc:  # noqa: BLE001 - answered in the protocol's envelope
        return call.fail(exc)


@get("/v2/models/{model:str}")
async def model_metadata(request: Request, model: str) -> Response[bytes]:
    return await _metadata(request, model, None)


@get("/v2/models/{model:str}/versions/{version:str}")
async def model_version_metadata(request: Request, model: str, version: str) -> Response[bytes]:
    return await _metadata(request, model, version)


async def _ready(request: Request, model: str, version: str | None) -> Response[bytes]:
    headers = lower_headers(request)
    call = Call("v2", headers)
    call.model = model
    try:
        core = _core(request)
        principal = await core.authenticate(headers)
        call.tenant = principal.tenant
        plan = core.plan(principal, model, version, None, headers)
        ok = any(core.is_healthy(d) for d in (plan.primary, *plan.fallbacks))
        call.done(200 if ok else 503)
        return _json({"name": model, "ready": ok}, 200 if ok else 503)
    except Exception as exc:  # noqa: BLE001
        return call.fail(exc)


@get("/v2/models/{model:str}/ready")
async def model_ready(request: Request, model: str) -> Response[bytes]:
    return await _ready(request, model, None)


@get("/v2/models/{model:str}/versions/{version:str}/ready")
async def model_version_ready(request: Request, model: str, version: str) -> Response[bytes]:
    return await _ready(request, model, version)


async def _infer(request: Request, model: str, version: str | None) -> ASGIApp:
    headers = lower_headers(request)
    call = Call("v2", headers)
    call.model = model
    try:
        core = _core(request)
        principal = await core.authenticate(headers)
        call.tenant = principal.tenant
        plan = core.plan(principal, model, version, None, headers)
        core.check_room(principal, plan)
        async with Deadline(core.config.server.request_timeout_s, call.started).scope():
            body = await read_body(request, core.config.server.max_body_bytes, headers=headers)
            header_len = headers.get("inference-header-content-length")
            decoded = decode_infer(body, _parse_header_length(header_len), call.request_id)
            response, served = await core.infer(principal, plan, decoded.request, queue_hints(headers))
        dep = served.deployment
        call.served_by(dep.name, dep.spec.backend, dep.device)
        payload, json_len = encode_infer(response, model, plan.version, decoded)
        out_headers = {
            **served.headers,
            "x-fleetgate-deployment": dep.served_by(),
            "x-request-id": call.echo_id,
        }
        if json_len is not None:
            out_headers["Inference-Header-Content-Length"] = str(json_len)
            media = "application/octet-stream"
        else:
            media = "application/json"
        call.done(200)
        return RawResponse(payload, 200, media, out_headers)
    except Exception as exc:  # noqa: BLE001
        return call.fail(exc)


def _parse_header_length(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise GatewayError(400, "invalid_header", "Inference-Header-Content-Length is not a number") from None


@post("/v2/models/{model:str}/infer", status_code=200)
async def infer(request: Request, model: str) -> ASGIApp:
    return await _infer(request, model, None)


@post("/v2/models/{model:str}/versions/{version:str}/infer", status_code=200)
async def infer_version(request: Request, model: str, version: str) -> ASGIApp:
    return await _infer(request, model, version)


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
