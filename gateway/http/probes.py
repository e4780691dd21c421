"""Liveness, readiness and /metrics: what probes and scrapers see, and what they need to see it.

Unauthenticated callers (a load balancer, a Kubernetes probe) learn only whether the process is
live and ready: never a tenant, model or deployment name. The per-deployment detail of readiness
and the whole of /metrics (tenant names, usage per model) need the admin key or the metrics key,
unless `admin.public_metrics` says the metrics port is private to the operator's network.
"""

from __future__ import annotations

import os

from litestar import Request, Response, get
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from fleetgate.errors import GatewayError
from gateway.admin.guard import operator_key_presented
from gateway.core.service import GatewayCore
from gateway.http.errors import exception_response
from gateway.observe import metrics
from gateway.observe.multiprocess import multiprocess_metrics
from gateway.observe.vllm_metrics import VllmNames


@get("/health/live", sync_to_thread=False)
def health_live() -> dict[str, str]:
    return {"status": "live"}


@get("/health/ready", sync_to_thread=False)
def health_ready(request: Request) -> Response[dict[str, object]]:
    """200 when the gateway can serve (`server.readiness`), else 503; detail for the operator only."""
    core: GatewayCore = request.app.state.core
    ok = core.ready()
    body: dict[str, object] = {"status": "ready" if ok else "not_ready"}
    try:
        operator = operator_key_presented(request)
    except GatewayError:  # an address throttled for guessing keys gets the plain answer
        operator = False
    if operator:
        body["deployments"] = core.deployment_status()
    return Response(body, status_code=200 if ok else 503)


@get("/metrics", sync_to_thread=False)
def metrics_endpoint(request: Request) -> Response[bytes]:
    core: GatewayCore = request.app.state.core
    admin = core.config.admin
    try:
        operator = admin.public_metrics or operator_key_presented(request)
    except GatewayError as exc:  # too many wrong keys from this address
        return exception_response("plain", exc)
    if not operator:
        if not any(os.environ.get(n) for n in (admin.key_env, admin.metrics_key_env)):
            error = GatewayError(
                403,
                "metrics_disabled",
                f"/metrics needs a key: set {admin.metrics_key_env} (or {admin.key_env}), "
                "or `admin.public_metrics: true` where the port is private",
            )
        else:
            error = GatewayError(401, "invalid_metrics_key", "missing or invalid metrics key")
        return exception_response("plain", error)
    return Response(content=exposition(core), media_type=CONTENT_TYPE_LATEST)


def exposition(core: GatewayCore) -> bytes:
    """The text /metrics serves (every worker's series when there are several); the console's
    live traffic page reads the same text."""
    # Queue depths, load estimates and route weights are read when scraped rather than updated
    # on every enqueue, dispatch and rollback.
    for name, dep in core.deployments.items():
        queue = dep.queue.stats()
        for tenant, stats in queue.tenants.items():
            metrics.QUEUE_DEPTH.labels(name, tenant).set(stats.depth)
        metrics.QUEUE_BACKGROUND.labels(name, "waiting").set(queue.background_depth)
        metrics.QUEUE_BACKGROUND.labels(name, "in_flight").set(queue.background_in_flight)
        service_s = core.service_times.get(name)
        if service_s is not None:
            metrics.SERVICE_TIME.labels(name, dep.device, dep.hardware).set(service_s)
        metrics.EXPECTED_WAIT.labels(name, dep.device, dep.hardware).set(core.expected_wait(name))
    metrics.ROUTE_WEIGHT.clear()  # models and routes come and go with reloads
    for model in core.router.names():
        for deployment, weight in core.router.effective_weights(model).items():
            metrics.ROUTE_WEIGHT.labels(model, deployment).set(weight)
    merged = multiprocess_metrics()  # server.workers > 1: every worker's series, summed
    if merged is None:  # one process: the default registry, and the engine's vLLM-named copies
        merged = generate_latest() + generate_latest(VllmNames(REGISTRY))
    return merged


ROUTES = [health_live, health_ready, metrics_endpoint]
