"""The Litestar application, built by `create_app(config)`.

Cheap, fallible work (deciding each deployment's backend and options) happens here, so a bad config
fails before the server binds a port. Resources (the state store, loaded models) are opened in the
lifespan and closed when the server stops.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import structlog
from litestar import Litestar, Request, Response, get
from litestar.exceptions import HTTPException
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import metrics
from gateway.admin import ROUTES as ADMIN_ROUTES
from gateway.config import Config, ConfigError
from gateway.core import GatewayCore
from gateway.deployments import build_deployments, close_deployments, open_deployments
from gateway.errors import Protocol, error_response
from gateway.http import register_metric_models
from gateway.protocols import kserve, openai, tfserving
from gateway.reload import ROUTES as RELOAD_ROUTES
from gateway.reload import install_sighup
from policies.admission import Admission
from policies.keys import KeyService
from policies.stores import open_store
from router.health import CircuitBreakers
from router.load import ServiceTimes
from router.planner import Router

log = structlog.get_logger(__name__)


@get("/health/live", sync_to_thread=False)
def health_live() -> dict[str, str]:
    return {"status": "live"}


@get("/health/ready", sync_to_thread=False)
def health_ready(request: Request) -> Response[dict[str, object]]:
    core: GatewayCore = request.app.state.core
    deployments = {
        name: {"ready": d.ready, "backend": d.spec.backend, "device": d.device, "error": d.load_error}
        for name, d in core.deployments.items()
    }
    ok = core.all_ready()
    return Response(
        {"status": "ready" if ok else "not_ready", "deployments": deployments}, status_code=200 if ok else 503
    )


@get("/metrics", sync_to_thread=False)
def metrics_endpoint(request: Request) -> Response[bytes]:
    core: GatewayCore | None = getattr(request.app.state, "core", None)
    if core is not None:
        # Queue depths, load estimates and route weights are read when scraped rather than updated
        # on every enqueue, dispatch and rollback.
        for name, dep in core.deployments.items():
            for tenant, stats in dep.queue.stats().tenants.items():
                metrics.QUEUE_DEPTH.labels(name, tenant).set(stats.depth)
            service_s = core.service_times.get(name)
            if service_s is not None:
                metrics.SERVICE_TIME.labels(name, dep.device, dep.hardware).set(service_s)
            metrics.EXPECTED_WAIT.labels(name, dep.device, dep.hardware).set(core.expected_wait(name))
        metrics.ROUTE_WEIGHT.clear()  # models and routes come and go with reloads
        for model in core.router.names():
            for deployment, weight in core.router.effective_weights(model).items():
                metrics.ROUTE_WEIGHT.labels(model, deployment).set(weight)
    return Response(content=generate_latest(), media_type=CONTENT_TYPE_LATEST)


def _protocol_of(path: str) -> Protocol:
    if path.startswith("/v2"):
        return "v2"
    if path.startswith("/v1/models/") and (":" in path or "/versions/" in path or "/labels/" in path):
        return "tfserving"
    if path.startswith("/v1"):
        return "openai"
    return "plain"


def _http_exception(request: Request, exc: HTTPException) -> Response[bytes]:
    """Litestar's own refusals (no such route, wrong method) in the caller's protocol envelope."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = "no such endpoint" if exc.status_code == 404 else str(exc.detail)
    return error_response(_protocol_of(request.url.path), exc.status_code, code, message)


def _unexpected(request: Request, exc: Exception) -> Response[bytes]:
    log.exception("unhandled_error", path=request.url.path, exc_info=exc)
    return error_response(
        _protocol_of(request.url.path), 500, "internal_error", "internal error; see the gateway log"
    )


def create_app(
    config: Config, *, clock: Callable[[], float] = time.time, config_path: str | Path | None = None
) -> Litestar:
    """Build the gateway app for `config`; `config_path` enables reload (`POST /admin/reload`, SIGHUP).

    Raises:
        ConfigError: a deployment's backend refuses its fields or options.
    """
    weights = {name: t.weight for name, t in config.tenants.items()}
    try:
        deployments = build_deployments(config, weights)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        store = await open_store(config.state.url)
        keys = KeyService(store, clock, tenants=list(config.tenants))
        admission = Admission(store, config.tenants, clock, fail_open_s=config.state.fail_open_s)
        breakers = CircuitBreakers(config.breakers.failure_threshold, config.breakers.cooldown_s)
        router = Router(
            config.models,
            is_healthy=lambda name: deployments[name].ready and breakers.allows(name),
            expected_wait=lambda name: app.state.core.expected_wait(name),
        )
        app.state.core = GatewayCore(
            config, deployments, router, keys, admission, breakers, service_times=ServiceTimes()
        )
        register_metric_models(config.models)
        app.state.store = store
        app.state.config_path = Path(config_path) if config_path is not None else None
        install_sighup(app)
        await open_deployments(deployments)
        log.info("gateway_started", deployments=len(deployments), models=len(config.models))
        try:
            yield
        finally:
            await app.state.core.shadows.close()
            await close_deployments(deployments)
            await store.close()

    return Litestar(
        route_handlers=[
            health_live,
            health_ready,
            metrics_endpoint,
            *kserve.ROUTES,
            *tfserving.ROUTES,
            *openai.ROUTES,
            *ADMIN_ROUTES,
            *RELOAD_ROUTES,
        ],
        lifespan=[lifespan],
        exception_handlers={HTTPException: _http_exception, Exception: _unexpected},
        request_max_body_size=None,  # enforced by gateway.http.read_body, in each protocol's envelope
        openapi_config=None,
        debug=False,
    )
