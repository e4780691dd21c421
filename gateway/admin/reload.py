"""Config hot reload: `POST /admin/reload` and SIGHUP.

Routes, weights, versions, labels, shadows, fallbacks, canary bounds, balance, breaker settings,
tenants, limits, quotas and tracing (`gateway/observe/telemetry.py`) change in place. A canary that was
rolled back stays rolled back if it is still a canary route of the same model after the reload (an
unrelated edit must not quietly send traffic back to a canary that misbehaved;
`POST /admin/canary/{model}/{deployment}/restore` does); a route that stops being a canary loses that
state (see router.canary). Requests in flight keep the objects they started with, so none is dropped.
A new config that does not parse, or that changes the `deployments:` section (which would mean
loading or unloading models), is refused and the running config stays; deployment changes need a
restart."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import msgspec
import structlog
from litestar import Litestar, Request, Response, post

from fleetgate.errors import GatewayError
from gateway.admin import audit
from gateway.admin.actor import AdminActor
from gateway.admin.guard import ADMIN_GUARD
from gateway.config import Config, ConfigError, load_config, with_listen_overrides
from gateway.core.calls import Call
from gateway.core.operations import Operations
from gateway.core.service import GatewayCore
from gateway.http.api_docs import ADMIN_ERRORS
from gateway.http.requests import http_failure
from policies.audit import AuditLog

log = structlog.get_logger(__name__)
_encoder = msgspec.json.Encoder()


def apply_config(core: GatewayCore, new: Config) -> None:
    """Swap the live config of a running gateway (gateway/core/operations.py). Raises ConfigError
    when it cannot be applied; the running config stays whole then."""
    Operations(core).apply_config(new)


async def reload_from_file(app: Litestar) -> Config:
    path: Path | None = getattr(app.state, "config_path", None)
    if path is None:
        raise ConfigError("this gateway was not started from a config file; nothing to reload")
    overrides = getattr(app.state, "listen_overrides", {})
    # read and checked off the event loop: a graph's checks read its steps' model files
    new = await asyncio.to_thread(lambda: with_listen_overrides(load_config(path), overrides))
    apply_config(app.state.core, new)
    app.state.admin_attempts.max_failures = new.admin.max_failures_per_minute
    await app.state.tracing.reconfigure(new.tracing)
    return new


async def reload_or_refuse(app: Litestar) -> Config:
    """`reload_from_file`, a refused config answered as 400 (the admin API's and the console's
    reload), recorded in the audit trail as the request's admin."""
    old = app.state.core.config
    try:
        new = await reload_from_file(app)
    except ConfigError as exc:
        raise GatewayError(400, "invalid_config", f"config refused, the running one stays: {exc}") from None
    await audit.record("config.reload", None, **config_change(old, new))
    return new


def config_change(old: Config, new: Config) -> dict[str, dict[str, list[str]]]:
    """A reload's audit `before` and `after`: names only (models, tenants, graphs) and which
    sections changed; never values, which may hold interpolated secrets."""

    def names(config: Config) -> dict[str, list[str]]:
        return {"models": sorted(config.models), "tenants": sorted(config.tenants), "graphs": sorted(config.graphs)}

    changed = [field for field in Config.__struct_fields__ if getattr(old, field) != getattr(new, field)]
    return {"before": names(old), "after": {**names(new), "changed_sections": changed}}


@post("/admin/reload", status_code=200, guards=ADMIN_GUARD, responses=ADMIN_ERRORS)
async def reload_endpoint(request: Request, call: Call) -> Response[bytes]:
    try:
        new = await reload_or_refuse(request.app)
        call.done(200)
        body = {"reloaded": True, "models": sorted(new.models), "tenants": sorted(new.tenants)}
        return Response(content=_encoder.encode(body), media_type="application/json")
    except Exception as exc:  # noqa: BLE001 - answered as {"error": ...}
        return http_failure(call, exc)


def install_sighup(app: Litestar) -> None:
    """Reload on SIGHUP where the loop may own signals (the main thread of `fleetgate serve`)."""

    async def reload() -> None:
        old = app.state.core.config
        try:
            new = await reload_from_file(app)
        except ConfigError as exc:
            log.error("config_reload_refused", error=str(exc))
            return
        by = AdminActor("signal:SIGHUP", "local", "signal", AuditLog(app.state.store))
        try:
            await audit.record("config.reload", None, by=by, **config_change(old, new))
        except Exception as exc:  # noqa: BLE001 - nobody to answer: the log says the entry is missing
            log.error("audit_entry_not_written", action="config.reload", error=f"{type(exc).__name__}: {exc}")

    pending: set[asyncio.Task[None]] = set()  # held until done (a bare task may be collected)

    def on_hup() -> None:
        task = asyncio.ensure_future(reload())
        pending.add(task)
        task.add_done_callback(pending.discard)

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, on_hup)
    except (RuntimeError, ValueError, NotImplementedError):
        log.debug("sighup_reload_unavailable")  # not the main thread (e.g. an embedded server in tests)


ROUTES = [reload_endpoint]
