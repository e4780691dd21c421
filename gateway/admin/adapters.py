"""Admin API for LoRA adapters: list, load and unload them on a running gateway, no restart.

    GET    /admin/adapters                                  every deployment's adapters and load errors
    POST   /admin/deployments/{deployment}/adapters         {"name": ..., "path": ...}: load (or replace)
    DELETE /admin/deployments/{deployment}/adapters/{name}  unload

Loading reads and checks the adapter off the event loop, then registers it between two engine
steps; unloading refuses new requests for the name at once while the ones in flight run to their
end. The adapter's model name appears to tenants whose `models:` globs match it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Annotated

import msgspec
import structlog
from litestar import Response, delete, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import Body

from backends.errors import BackendUnavailable, InvalidInput
from backends.sources import ModelSources, SourceError, is_address
from backends.sources.errors import Unreachable
from fleetgate.errors import GatewayError
from gateway.admin import audit
from gateway.admin.guard import ADMIN_GUARD
from gateway.config.checks import model_name_problem
from gateway.core.calls import Call
from gateway.core.fleet.deployments import Deployment
from gateway.core.operations import Operations
from gateway.core.service import GatewayCore
from gateway.http.api_docs import ADMIN_ERRORS, PlainError
from gateway.http.bodies import read_within_deadline
from gateway.http.requests import ADMIN_BODY_LIMIT, http_failure, json_response

log = structlog.get_logger(__name__)

#: `responses=` of the adapter routes: the admin API's errors and what loading adds
ADAPTER_ERRORS = {
    **ADMIN_ERRORS,
    404: ResponseSpec(PlainError, description="no such deployment, or no such adapter on it", generate_examples=False),
    409: ResponseSpec(PlainError, description="server.workers > 1: declare adapters in the config", generate_examples=False),
    413: ResponseSpec(PlainError, description="body too large", generate_examples=False),
    415: ResponseSpec(PlainError, description="not JSON", generate_examples=False),
    503: ResponseSpec(PlainError, description="the adapter's model store cannot be reached", generate_examples=False),
}


class LoadAdapterBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    #: the PEFT adapter folder, on the gateway's file system, or a model address (hf://, s3://,
    #: https://) fetched into the model cache first
    path: str


def _lora_deployment(core: GatewayCore, deployment: str) -> Deployment:
    if core.config.server.workers > 1:
        raise GatewayError(
            409,
            "adapters_need_one_worker",
            "with server.workers > 1 a run-time change would reach one worker only: declare the adapter "
            "under the deployment's `adapters` and restart",
        )
    dep = core.deployments.get(deployment)
    if dep is None:
        raise GatewayError(404, "deployment_not_found", f"no deployment {deployment!r}")
    if not hasattr(dep.backend, "load_adapter"):
        raise InvalidInput(
            f"deployment {deployment!r} ({dep.spec.backend}) does not serve LoRA adapters; torch_llm does"
        )
    return dep


def _check_name(core: GatewayCore, name: str, deployment: str) -> None:
    # the model-name rule: whatever loads here can be addressed by the DELETE below
    problem = model_name_problem(name)
    if problem is not None:
        raise InvalidInput(f"adapter name: {problem}")
    if name in core.config.models or name in core.config.graphs:
        raise InvalidInput(f"{name!r} is a model in the config; an adapter needs a name of its own")
    owner = core.adapter_models.get(name)
    if owner is not None and owner != deployment:
        raise InvalidInput(f"adapter {name!r} is served by deployment {owner!r}; unload it there first")


async def _adapter_folder(core: GatewayCore, path: str) -> str:
    """The adapter's folder on the gateway: a local path as given, or a model address fetched into
    the model cache (off the event loop; a store that cannot be reached is a 503, the rest 400)."""
    if is_address(path):
        try:
            return str(await asyncio.to_thread(ModelSources(core.config.storage).fetch, path))
        except Unreachable as exc:
            raise BackendUnavailable(f"adapter path: {exc}") from None
        except SourceError as exc:
            raise InvalidInput(f"adapter path: {exc}") from None
    if not os.path.isdir(path):
        raise InvalidInput(f"adapter folder {path!r} does not exist on the gateway")
    return path


@get("/admin/adapters", guards=ADMIN_GUARD, responses=ADAPTER_ERRORS)
async def list_adapters(core: GatewayCore, call: Call) -> Response[bytes]:
    try:
        out = {}
        for name, dep in core.deployments.items():
            backend = dep.backend
            if hasattr(backend, "load_adapter"):
                out[name] = {"adapters": dict(backend.adapters), "errors": dict(backend.adapter_errors)}
        call.done(200)
        return json_response({"deployments": out})
    except Exception as exc:  # noqa: BLE001 - answered as {"error": ...}
        return http_failure(call, exc)


@post(
    "/admin/deployments/{deployment:str}/adapters",
    status_code=201,
    guards=ADMIN_GUARD,  # the admin key is checked first, then the body read under the deadline and decoded
    before_request=read_within_deadline,
    request_max_body_size=ADMIN_BODY_LIMIT,
    responses=ADAPTER_ERRORS,
)
async def load_adapter(
    core: GatewayCore, call: Call, deployment: str, data: Annotated[LoadAdapterBody, Body(title="Adapter to load")]
) -> Response[bytes]:
    body = data  # decoded by Litestar; its refusals answer in the admin envelope (gateway/http/bodies.py)
    try:
        dep = _lora_deployment(core, deployment)
        _check_name(core, body.name, deployment)
        folder = await _adapter_folder(core, body.path)
        before = dict(dep.backend.adapters).get(body.name)
        await dep.backend.load_adapter(body.name, folder)
        Operations(core).serve_adapter(body.name, deployment)
        log.info("adapter_loaded", deployment=deployment, adapter=body.name)
        after = dict(dep.backend.adapters).get(body.name)
        await audit.record("adapters.load", f"{deployment}/{body.name}", before=before, after=after)
        call.done(201)
        return json_response(
            {"name": body.name, "deployment": deployment, "parent": core.adapter_parent(body.name)}, 201
        )
    except Exception as exc:  # noqa: BLE001
        return http_failure(call, exc)


# `path`: an adapter name may hold `/` (`acme/support`), which a `str` parameter never matches
@delete(
    "/admin/deployments/{deployment:str}/adapters/{name:path}",
    status_code=200,
    guards=ADMIN_GUARD,
    responses=ADAPTER_ERRORS,
)
async def unload_adapter(core: GatewayCore, call: Call, deployment: str, name: str) -> Response[bytes]:
    name = name.removeprefix("/")  # the framework hands a path parameter over with its leading slash
    try:
        dep = _lora_deployment(core, deployment)
        if core.adapter_models.get(name) != deployment:
            raise GatewayError(
                404, "adapter_not_found", f"deployment {deployment!r} serves no adapter {name!r}"
            )
        # routing stops first, so no new request is planned onto an adapter being unloaded
        before = dict(dep.backend.adapters).get(name)
        Operations(core).stop_serving_adapter(name)
        await dep.backend.unload_adapter(name)
        log.info("adapter_unloaded", deployment=deployment, adapter=name)
        await audit.record("adapters.unload", f"{deployment}/{name}", before=before)
        call.done(200)
        return json_response({"name": name, "deployment": deployment, "unloaded": True})
    except Exception as exc:  # noqa: BLE001
        return http_failure(call, exc)


ROUTES = [list_adapters, load_adapter, unload_adapter]
