"""Admin API under /admin/: keys, usage and canaries, guarded by the admin key, never a tenant key.

Every route carries `ADMIN_GUARD` (gateway/admin/guard.py): the one check of the admin key.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

import msgspec
import structlog
from litestar import Response, delete, get, post
from litestar.params import Body

from backends.errors import InvalidInput
from fleetgate.errors import GatewayError
from gateway.admin import audit
from gateway.admin.guard import ADMIN_GUARD
from gateway.core.calls import Call
from gateway.core.operations import Operations
from gateway.core.service import GatewayCore
from gateway.http.api_docs import ADMIN_ERRORS
from gateway.http.bodies import read_within_deadline
from gateway.http.requests import ADMIN_BODY_LIMIT, http_failure, json_response
from policies.types import Budget, KeyRecord, Limits

log = structlog.get_logger(__name__)


class CreateKeyBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tenant: str
    models: list[str] | None = None
    expires_at: datetime | None = None
    name: str | None = None
    #: the key's own rate limits (in place of its tenant's `key_limits`; the tenant's still apply)
    limits: Limits | None = None
    #: the key's own budget in USD (beside its tenant's)
    budget: Budget | None = None


# --- the actions, shared by these routes and the console (gateway/admin/console/) -----------------------


async def create_tenant_key(core: GatewayCore, body: CreateKeyBody) -> tuple[KeyRecord, str]:
    """Create a key of `body.tenant`; its record and its secret (shown once). 400 on bad input."""
    try:
        record, secret = await core.keys.create(
            body.tenant, body.models, body.expires_at, body.name, limits=body.limits, budget=body.budget
        )
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    await audit.record("keys.create", record.key_id, after=record)
    return record, secret


async def revoke_tenant_key(core: GatewayCore, key_id: str) -> None:
    """Revoke a key on every replica (within a second); 404 when there is no such key."""
    was_active = await core.keys.still_valid(key_id)
    if not await core.keys.revoke(key_id):
        raise GatewayError(404, "key_not_found", f"no key {key_id!r}")
    await audit.record("keys.revoke", key_id, before={"active": was_active}, after={"active": False})


async def restore_canary(core: GatewayCore, model: str, deployment: str) -> dict[str, object]:
    """Give a rolled-back canary its configured weight back; 404 when it is not a canary route."""
    try:
        was_rolled_back, weight = Operations(core).restore_canary(model, deployment)
    except KeyError:
        raise GatewayError(
            404, "canary_not_found", f"model {model!r} has no canary route {deployment!r}"
        ) from None
    log.info("canary_restored", model=model, deployment=deployment, was_rolled_back=was_rolled_back)
    answer = {"model": model, "deployment": deployment, "restored": was_rolled_back, "weight": weight}
    await audit.record(
        "canary.restore", f"{model}/{deployment}", before={"rolled_back": was_rolled_back}, after=answer
    )
    return answer


# --- routes ----------------------------------------------------------------------------------------


@post(
    "/admin/keys",
    status_code=201,
    guards=ADMIN_GUARD,  # the admin key is checked first, then the body read under the deadline and decoded
    before_request=read_within_deadline,
    request_max_body_size=ADMIN_BODY_LIMIT,
    responses=ADMIN_ERRORS,
)
async def create_key(
    core: GatewayCore, call: Call, data: Annotated[CreateKeyBody, Body(title="New key")]
) -> Response[bytes]:
    try:
        body = data  # decoded by Litestar after the admin guard (gateway/http/bodies.py)
        record, secret = await create_tenant_key(core, body)
        call.tenant = body.tenant
        call.done(201)
        return json_response({"key": secret, **msgspec.to_builtins(record)}, 201)
    except Exception as exc:  # noqa: BLE001 - answered as {"error": ...}
        return http_failure(call, exc)


@get("/admin/keys", guards=ADMIN_GUARD, responses=ADMIN_ERRORS)
async def list_keys(core: GatewayCore, call: Call, tenant: str | None = None) -> Response[bytes]:
    try:
        records = await core.keys.list(tenant)
        call.done(200)
        return json_response({"keys": msgspec.to_builtins(records)})
    except Exception as exc:  # noqa: BLE001
        return http_failure(call, exc)


@delete("/admin/keys/{key_id:str}", status_code=200, guards=ADMIN_GUARD, responses=ADMIN_ERRORS)
async def revoke_key(core: GatewayCore, call: Call, key_id: str) -> Response[bytes]:
    try:
        await revoke_tenant_key(core, key_id)
        call.done(200)
        return json_response({"key_id": key_id, "revoked": True})
    except Exception as exc:  # noqa: BLE001
        return http_failure(call, exc)


@get("/admin/usage", guards=ADMIN_GUARD, responses=ADMIN_ERRORS)
async def usage(core: GatewayCore, call: Call, tenant: str | None = None, by: str = "model") -> Response[bytes]:
    """Usage and spend per tenant, model and period (`by=model`), or per key, model, deployment and
    period (`by=key`)."""
    try:
        if by not in ("model", "key"):
            raise InvalidInput(f"by must be model or key, got {by!r}")
        rows = await (core.admission.usage(tenant) if by == "model" else core.admission.key_usage(tenant))
        # A tenant removed from the config keeps its history; a name that is neither configured nor
        # in the history is a typo, and an empty list would hide it.
        if tenant is not None and not rows and tenant not in core.config.tenants:
            raise GatewayError(
                404, "tenant_not_found", f"no tenant {tenant!r} in the config or the usage history"
            )
        call.done(200)
        return json_response({"usage": msgspec.to_builtins(rows)})
    except Exception as exc:  # noqa: BLE001
        return http_failure(call, exc)


@get("/admin/canary", guards=ADMIN_GUARD, responses=ADMIN_ERRORS)
async def canary_status(core: GatewayCore, call: Call) -> Response[bytes]:
    """Every canary route: rolled back or not, its window, and why it was rolled back."""
    try:
        call.done(200)
        return json_response({"canaries": msgspec.to_builtins(core.router.canaries.status())})
    except Exception as exc:  # noqa: BLE001
        return http_failure(call, exc)


@post("/admin/canary/{model:str}/{deployment:str}/restore", status_code=200, guards=ADMIN_GUARD, responses=ADMIN_ERRORS)
async def canary_restore(core: GatewayCore, call: Call, model: str, deployment: str) -> Response[bytes]:
    """Give a rolled-back canary its configured weight back (its window starts afresh)."""
    try:
        answer = await restore_canary(core, model, deployment)
        call.done(200)
        return json_response(answer)
    except Exception as exc:  # noqa: BLE001
        return http_failure(call, exc)


ROUTES = [create_key, list_keys, revoke_key, usage, canary_status, canary_restore, audit.audit_trail]
