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

import msgspec
from litestar import Request, Response, get, post

from backends.errors import InvalidInput, ModelNotFound
from gateway.core import GatewayCore
from gateway.deadline import Deadline
from gateway.errors import Protocol
from gateway.http import Call, lower_headers, read_body
from gateway.protocols.tfserving_codec import decode_predict, encode_predict, signature_def
from gateway.queue_hints import queue_hints

_encoder = msgspec.json.Encoder()
VERBS = ("predict", "classify", "regress")
_STARTED = int(time.time())


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response[bytes]:
    return Response(
        content=_encoder.encode(payload), status_code=status, media_type="application/json", headers=headers
    )


def _split_verb(segment: str) -> tuple[str, str]:
    """`digits:predict` -> ("digits", "predict"); a missing or unknown verb is a 404-like 400."""
    name, sep, verb = segment.rpartition(":")
    if not sep or verb not in VERBS:
        raise ModelNotFound(f"no such method: {segment!r} (expected <model>:predict)")
    if verb != "predict":
        raise InvalidInput(f"`:{verb}` is not supported; use `:predict`")
    return name, verb


async def _predict(request: Request, model: str, segment: str, slot: str) -> Response[bytes]:
    """`segment` is the last path segment (`name:predict`); its name fills `slot` (model/version/label)."""
    headers = lower_headers(request)
    call = Call("tfserving", headers)
    call.model = model
    version: str | None = None
    label: str | None = None
    try:
        name, _ = _split_verb(segment)
        if slot == "model":
            model = call.model = name
        elif slot == "version":
            version = name
        else:
            label = name
        core: GatewayCore = request.app.state.core
        principal = await core.authenticate(headers)
        call.tenant = principal.tenant
        plan = core.plan(principal, model, version, label, headers)
        core.check_room(principal, plan)
        async with Deadline(core.config.server.request_timeout_s, call.started).scope():
            body = await read_body(request, core.config.server.max_body_bytes)
            meta = core.deployments[plan.primary].backend.metadata()
            decoded = decode_predict(body, meta, call.request_id)
            response, served = await core.infer(principal, plan, decoded.request, queue_hints(headers))
        dep = served.deployment
        call.served_by(dep.name, dep.spec.backend, dep.device)
        out = {**served.headers, "x-fleetgate-deployment": dep.served_by(), "x-request-id": call.echo_id}
        call.done(200)
        return Response(
            content=encode_predict(response, decoded.row_form), media_type="application/json", headers=out
        )
    except Exception as exc:  # noqa: BLE001 - answered in the protocol's envelope
        return call.fail(exc)


@post("/v1/models/{segment:str}", status_code=200)
async def predict(request: Request, segment: str) -> Response[bytes]:
    return await _predict(request, "", segment, "model")


@post("/v1/models/{model:str}/versions/{segment:str}", status_code=200)
async def predict_version(request: Request, model: str, segment: str) -> Response[bytes]:
    return await _predict(request, model, segment, "version")


@post("/v1/models/{model:str}/labels/{segment:str}", status_code=200)
async def predict_label(request: Request, model: str, segment: str) -> Response[bytes]:
    return await _predict(request, model, segment, "label")


def _version_status(core: GatewayCore, model: str, version: str | None) -> list[dict[str, Any]]:
    spec = core.router.get(model)
    versions = [version] if version is not None else (sorted(spec.versions) or [None])
    out = []
    for v in versions:
        deployments = [spec.versions[v]] if v is not None else [r.deployment for r in spec.routes]
        ok = any(core.is_healthy(d) for d in deployments)
        out.append(
            {
                "version": v or "1",
                "state": "AVAILABLE" if ok else "UNAVAILABLE",
                "status": {"error_code": "OK", "error_message": ""},
            }
        )
    return out


async def _status(request: Request, model: str, version: str | None, label: str | None, protocol: Protocol):  # type: ignore[no-untyped-def]
    headers = lower_headers(request)
    call = Call(protocol, headers)
    call.model = model
    try:
        core: GatewayCore = request.app.state.core
        principal = await core.authenticate(headers)
        call.tenant = principal.tenant
        plan = core.plan(principal, model, version, label, headers)
        body: dict[str, Any] = {"model_version_status": _version_status(core, model, plan.version)}
        if protocol == "openai":
            # One body, two readers: the OpenAI Model object rides along (see the module docstring).
            body.update({"id": model, "object": "model", "created": _STARTED, "owned_by": principal.tenant})
        call.done(200)
        return _json(body)
    except Exception as exc:  # noqa: BLE001
        return call.fail(exc)


@get("/v1/models/{model:str}")
async def model_status(request: Request, model: str) -> Response[bytes]:
    return await _status(request, model, None, None, "openai")


@get("/v1/models/{model:str}/versions/{version:str}")
async def model_version_status(request: Request, model: str, version: str) -> Response[bytes]:
    return await _status(request, model, version, None, "tfserving")


@get("/v1/models/{model:str}/labels/{label:str}")
async def model_label_status(request: Request, model: str, label: str) -> Response[bytes]:
    return await _status(request, model, None, label, "tfserving")


async def _metadata(request: Request, model: str, version: str | None, label: str | None) -> Response[bytes]:
    headers = lower_headers(request)
    call = Call("tfserving", headers)
    call.model = model
    try:
        core: GatewayCore = request.app.state.core
        principal = await core.authenticate(headers)
        call.tenant = principal.tenant
        plan = core.plan(principal, model, version, label, headers)
        meta = core.deployments[plan.primary].backend.metadata()
        body = {
            "model_spec": {"name": model, "signature_name": "", "version": plan.version or "1"},
            "metadata": {"signature_def": signature_def(meta)},
        }
        call.done(200)
        return _json(body)
    except Exception as exc:  # noqa: BLE001
        return call.fail(exc)


@get("/v1/models/{model:str}/metadata")
async def model_metadata(request: Request, model: str) -> Response[bytes]:
    return await _metadata(request, model, None, None)


@get("/v1/models/{model:str}/versions/{version:str}/metadata")
async def model_version_metadata(request: Request, model: str, version: str) -> Response[bytes]:
    return await _metadata(request, model, version, None)


@get("/v1/models/{model:str}/labels/{label:str}/metadata")
async def model_label_metadata(request: Request, model: str, label: str) -> Response[bytes]:
    return await _metadata(request, model, None, label)


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
