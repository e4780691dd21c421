"""Admin API under /admin/: keys, usage and canaries, guarded by the admin key, never a tenant key.

The admin key is read from the environment variable named by `admin.key_env` when the app starts
a request (so rotating it needs no restart) and compared in constant time. With the variable unset
the admin API is off and answers 403.
"""

from __future__ import annotations

import hmac
import os
from datetime import datetime
from typing import Any

import msgspec
import structlog
from litestar import Request, Response, delete, get, post

from backends.errors import InvalidInput
from backends.json_errors import JSON_DECODE_ERRORS, describe_decode_error
from gateway.admin_guard import AdminAttempts
from gateway.core import GatewayCore, extract_key
from gateway.errors import GatewayError
from gateway.http import Call, lower_headers, read_body

_encoder = msgspec.json.Encoder()
log = structlog.get_logger(__name__)


class CreateKeyBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tenant: str
    models: list[str] | None = None
    expires_at: datetime | None = None
    name: str | None = None


def require_admin(request: Request) -> GatewayCore:
    core: GatewayCore = request.app.state.core
    expected = os.environ.get(core.config.admin.key_env, "")
    if not expected:
        raise GatewayError(
            403, "admin_disabled", f"the admin API is off: set {core.config.admin.key_env} to enable it"
        )
    attempts: AdminAttempts = request.app.state.admin_attempts
    address = request.client.host if request.client else "unknown"
    attempts.check(address)
    presented = extract_key(lower_headers(request)) or ""
    if not hmac.compare_digest(presented.encode(), expected.encode()):
        attempts.failed(address)
        raise GatewayError(401, "invalid_admin_key", "missing or invalid admin key")
    return core


def _json(payload: Any, status: int = 200) -> Response[bytes]:
    return Response(content=_encoder.encode(payload), status_code=status, media_type="application/json")


@post("/admin/keys", status_code=201)
async def create_key(request: Request) -> Response[bytes]:
    call = Call("plain", lower_headers(request))
    try:
        core = require_admin(request)
        raw = await read_body(request, 64 * 1024, allowed_types=("application/json", ""))
        try:
            body = msgspec.json.decode(raw, type=CreateKeyBody)
        except JSON_DECODE_ERRORS as exc:
            raise InvalidInput(describe_decode_error(exc)) from None
        try:
            record, secret = await core.keys.create(body.tenant, body.models, body.expires_at, body.name)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        call.tenant = body.tenant
        call.done(201)
        return _json({"key": secret, **msgspec.to_builtins(record)}, 201)
    except Exception as exc:  # noqa: BLE001 - answered as {"error": ...}
        return call.fail(exc)


@get("/admin/keys")
async def list_keys(request: Request, tenant: str | None = None) -> Response[bytes]:
    call = Call("plain", lower_headers(request))
    try:
        core = require_admin(request)
        records = await core.keys.list(tenant)
        call.done(200)
        return _json({"keys": msgspec.to_builtins(records)})
    except Exception as exc:  # noqa: BLE001
        return call.fail(exc)


@delete("/admin/keys/{key_id:str}", status_code=200)
async def revoke_key(request: Request, key_id: str) -> Response[bytes]:
    call = Call("plain", lower_headers(request))
    try:
        core = require_admin(request)
        if not await core.keys.revoke(key_id):
            raise GatewayError(404, "key_not_found", f"no key {key_id!r}")
        call.done(200)
        return _json({"key_id": key_id, "revoked": True})
    except Exception as exc:  # noqa: BLE001
        return call.fail(exc)


@get("/admin/usage")
async def usage(request: Request, tenant: str | None = None) -> Response[bytes]:
    call = Call("plain", lower_headers(request))
    try:
        core = require_admin(request)
        rows = await core.admission.usage(tenant)
        # A tenant removed from the config keeps its history; a name that is neither configured nor
        # in the history is a typo, and an empty list would hide it.
        if tenant is not None and not rows and tenant not in core.config.tenants:
            raise GatewayError(
                404, "tenant_not_found", f"no tenant {tenant!r} in the config or the usage history"
            )
        call.done(200)
        return _json({"usage": msgspec.to_builtins(rows)})
    except Exception as exc:  # noqa: BLE001
        return call.fail(exc)


@get("/admin/canary")
async def canary_status(request: Request) -> Response[bytes]:
    """Every canary route: rolled back or not, its window, and why it was rolled back."""
    call = Call("plain", lower_headers(request))
    try:
        core = require_admin(request)
        call.done(200)
        return _json({"canaries": msgspec.to_builtins(core.router.canaries.status())})
    except Exception as exc:  # noqa: BLE001
        return call.fail(exc)


@post("/admin/canary/{model:str}/{deployment:str}/restore", status_code=200)
async def canary_restore(request: Request, model: str, deployment: str) -> Response[bytes]:
    """Give a rolled-back canary its configured weight back (its window starts afresh)."""
    call = Call("plain", lower_headers(request))
    try:
        core = require_admin(request)
        try:
            was_rolled_back = core.router.canaries.restore(model, deployment)
        except KeyError:
            raise GatewayError(
                404, "canary_not_found", f"model {model!r} has no canary route {deployment!r}"
            ) from None
        weight = core.router.effective_weights(model)[deployment]
        log.info("canary_restored", model=model, deployment=deployment, was_rolled_back=was_rolled_back)
        call.done(200)
        return _json(
            {"model": model, "deployment": deployment, "restored": was_rolled_back, "weight": weight}
        )
    except Exception as exc:  # noqa: BLE001
        return call.fail(exc)


ROUTES = [create_key, list_keys, revoke_key, usage, canary_status, canary_restore]
