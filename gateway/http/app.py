"""The Litestar application, built by `create_app(config)`.

Cheap, fallible work (deciding each deployment's backend and options) happens here, so a bad config
fails before the server binds a port. Resources (the state store, loaded models) are opened in the
lifespan and closed when the server stops.
"""

from __future__ import annotations

import gc
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import structlog
from litestar import Litestar, Request, Response, Router
from litestar.exceptions import HTTPException

from backends.errors import InvalidInput
from backends.runtime.json_errors import JSON_DECODE_ERRORS, describe_decode_error
from gateway.admin.adapters import ROUTES as LORA_ROUTES
from gateway.admin.api import ROUTES as ADMIN_ROUTES
from gateway.admin.console.pages import TEMPLATES as CONSOLE_TEMPLATES
from gateway.admin.console.routes import ROUTER as CONSOLE_ROUTER
from gateway.admin.console.traffic import TrafficWindow
from gateway.admin.guard import AdminAttempts
from gateway.admin.reload import ROUTES as RELOAD_ROUTES
from gateway.admin.reload import install_sighup
from gateway.batches.routes import ROUTES as BATCH_ROUTES
from gateway.batches.service import BatchService
from gateway.config import Config, ConfigError
from gateway.core.calls import register_metric_models
from gateway.core.drain_state import DrainState
from gateway.core.fleet.deployments import LoadRetries, build_deployments, close_deployments, open_deployments
from gateway.core.money.alerts import BudgetAlertSink
from gateway.core.service import GatewayCore
from gateway.grpc.server import check_grpc_port, start_grpc
from gateway.http import kserve, openai, openai_embeddings, openapi, probes, tfserving
from gateway.http.api_docs import KEYED
from gateway.http.bodies import call_of, refusal_response
from gateway.http.requests import DEPENDENCIES, http_failure
from gateway.observe.telemetry import TracingSwitch
from gateway.serve import liveness
from gateway.serve.health_listener import start_configured
from policies.admission import Admission
from policies.keys import KeyService
from policies.stores import open_store
from router.health import CircuitBreakers
from router.load import ServiceTimes

log = structlog.get_logger(__name__)

#: allocations (net of frees) between two young-generation collections in `fleetgate serve`, instead
#: of CPython's 700. A proxied request allocates a few thousand short-lived objects, nearly all freed
#: by reference counting, so at 700 the collector ran several times a request for nothing to free.
#: An A/B on bench_policy_proxy's chat path (nothing to enforce, wrk c=16, 4 rounds side by side, with
#: the older generations at 20 and 100 in that trial): about 5 % less CPU a request. Cycles still die,
#: at most this many allocations later.
_YOUNG_COLLECTION_EVERY = 50_000


def _raised(request: Request, exc: Exception) -> Response[bytes]:
    """What a guard, a hook or a dependency raised: a known error in the caller's protocol envelope
    (with its access-log line); JSON that msgspec refused beneath Litestar's decoding (invalid
    UTF-8, nesting too deep) is the client's 400; anything else is an internal error whose details
    go to the log only."""
    if isinstance(exc, JSON_DECODE_ERRORS):
        exc = InvalidInput(describe_decode_error(exc))
    return http_failure(call_of(request), exc)


def create_served_app(config: Config, config_path: str | Path, listen: dict[str, object]) -> Litestar:
    """The app `fleetgate serve` runs (in each worker too): reloadable from `config_path`, with the
    command line's host/port kept across reloads (they are not config changes).

    Raises:
        ConfigError: as create_app; GrpcPortBusy (one line naming the port and its holder) when the
            gRPC port is taken, before anything loads, rather than from inside the app's start-up.
    """
    check_grpc_port(config)
    app = create_app(config, config_path=config_path, freeze_startup_heap=True)
    app.state.listen_overrides = listen
    return app


def create_app(
    config: Config,
    *,
    clock: Callable[[], float] = time.time,
    config_path: str | Path | None = None,
    span_exporter: Any = None,
    freeze_startup_heap: bool = False,
) -> Litestar:
    """Build the gateway app for `config`; `config_path` enables reload (`POST /admin/reload`, SIGHUP).

    `freeze_startup_heap` (what `fleetgate serve` sets) hides what start-up made from the garbage
    collector once the app is up (`gc.freeze`): modules, models and routes live as long as the
    process, and full collections then walk only what requests made. Measured on the digits path:
    full collections of the whole heap took ~40 ms each, several a minute under load; ~3 ms frozen.
    Left off for apps made in a process that makes many (tests): a frozen cycle is never freed.
    It also spaces the young-generation collections (`gc.set_threshold`, `_YOUNG_COLLECTION_EVERY`).

    Raises:
        ConfigError: a deployment's backend refuses its fields or options.
    """
    weights = {name: t.weight for name, t in config.tenants.items()}
    try:
        deployments = build_deployments(config, weights)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None

    drain = DrainState()

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.tracing = TracingSwitch(config.tracing, span_exporter)
        store = await open_store(config.state.url)
        keys = KeyService(store, clock, tenants=list(config.tenants))
        alerts = BudgetAlertSink(config.budget_alerts)
        admission = Admission(
            store, config.tenants, clock, fail_open_s=config.state.fail_open_s,
            budget_thresholds=config.budget_alerts.thresholds, budget_sink=alerts,
            leases=config.state.leases, partition=config.state.partition,
        )  # fmt: skip
        breakers = CircuitBreakers(config.breakers.failure_threshold, config.breakers.cooldown_s)
        app.state.core = GatewayCore.assemble(
            config, deployments, keys, admission, breakers, ServiceTimes(), drain=drain
        )
        # the probes' own port, up while models load and through the drain (gateway/serve/health_listener.py)
        health = await start_configured(config.server, lambda: app.state.core.ready())
        app.state.health_listener = health
        register_metric_models([*app.state.core.served_models(), *config.graphs])
        app.state.store = store
        app.state.admin_attempts = AdminAttempts(config.admin.max_failures_per_minute)
        app.state.config_path = Path(config_path) if config_path is not None else None
        install_sighup(app)
        beating = await liveness.start(admission)
        retries = LoadRetries()
        app.state.load_retries = retries
        await open_deployments(deployments, retries)
        app.state.grpc = await start_grpc(config, lambda: app.state.core)
        batches = BatchService.open(config.batches, store, admission, lambda: app.state.core, clock)
        app.state.batches = batches
        batches.runner.start()
        log.info("gateway_started", deployments=len(deployments), models=len(config.models))
        if freeze_startup_heap:
            gc.collect()
            gc.freeze()
            gc.set_threshold(_YOUNG_COLLECTION_EVERY, *gc.get_threshold()[1:])
        try:
            yield
        finally:
            if app.state.grpc is not None:
                # SIGTERM's drain covers HTTP; gRPC calls in flight get a short grace of their own
                await app.state.grpc.stop(min(5.0, config.server.shutdown_timeout_s))
            await retries.cancel()
            await batches.runner.stop()
            # settlements of streams the shutdown cut still write usage: let them finish first
            await app.state.core.settlement.wait_all()
            await liveness.stop(beating)
            await app.state.core.shadows.close()
            await close_deployments(deployments)
            await keys.uses_written()  # the last-use writes still in flight go to the store first
            await admission.budget_watch.settled()
            await admission.close()  # the slices' unused units back, the last batch written
            await alerts.close()
            await store.close()
            await app.state.tracing.shutdown()
            if health is not None:
                await health.close()

    app = Litestar(
        route_handlers=[
            *probes.ROUTES,
            *openapi.ROUTES,
            *kserve.ROUTES,
            *tfserving.ROUTES,
            *openai.ROUTES,
            *openai_embeddings.ROUTES,
            Router("/", route_handlers=BATCH_ROUTES, security=KEYED),
            # operators' routes stay out of the client document; /admin/openapi.json has them
            Router(
                "/",
                route_handlers=[*ADMIN_ROUTES, *LORA_ROUTES, *RELOAD_ROUTES, CONSOLE_ROUTER],
                include_in_schema=False,
            ),
        ],
        template_config=CONSOLE_TEMPLATES,
        lifespan=[lifespan],
        exception_handlers={HTTPException: refusal_response, Exception: _raised},
        dependencies=DEPENDENCIES,
        # typed bodies (gateway/http/bodies.py); the raw tensor reads enforce the same limit themselves
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=openapi.openapi_config("fleetgate"),  # one per app: Litestar fills its components
        debug=False,
    )
    app.state.console_traffic = TrafficWindow()  # the console's live traffic window, per process
    app.state.drain = drain  # read by `fleetgate serve`'s DrainingServer (gateway/serve/drain.py)
    return app
