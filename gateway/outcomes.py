"""What one attempt on a deployment teaches the gateway: breaker state, canary watch, service time."""

from __future__ import annotations

import structlog

from backends.errors import BackendInternalError, BackendTimeout, BackendUnavailable
from gateway import metrics
from gateway.deployments import Deployment
from router.health import CircuitBreakers
from router.load import ServiceTimes
from router.planner import Router

log = structlog.get_logger(__name__)

#: errors that count against a deployment (breaker, canary); the caller's own mistakes do not
DEPLOYMENT_FAULTS = (BackendUnavailable, BackendTimeout, BackendInternalError)


class Outcomes:
    """Feeds attempt outcomes to the circuit breakers, the canary watch and the service-time EWMA."""

    def __init__(self, breakers: CircuitBreakers, router: Router, service_times: ServiceTimes) -> None:
        self.breakers = breakers
        self.router = router
        self.service_times = service_times

    def record(
        self,
        model: str,
        dep: Deployment,
        error: BaseException | None,
        latency_s: float,
        service_s: float | None = None,
    ) -> None:
        """Record one attempt.

        Args:
            model: the logical model the attempt served (canaries are judged per model).
            dep: the deployment tried.
            error: what it raised, or None.
            latency_s: the attempt as the caller saw it (queue wait included; first event for streams).
            service_s: the backend's own time, for the load estimate (successes only).
        """
        fault = isinstance(error, DEPLOYMENT_FAULTS)
        self._breaker(dep, error, fault)
        if error is None and service_s is not None:
            self.service_times.observe(dep.name, service_s)
        # A caller's mistake (bad input, queue full) says nothing about the canary either way.
        if (error is None or fault) and self.router.canaries.watches(model):
            rollback = self.router.canaries.record(model, dep.name, not fault, latency_s)
            if rollback is not None:
                metrics.CANARY_ROLLBACKS.labels(model, dep.name, rollback.reason).inc()
                metrics.ROUTE_WEIGHT.labels(model, dep.name).set(0)
                log.warning(
                    "canary_rolled_back",
                    model=model,
                    deployment=dep.name,
                    reason=rollback.reason,
                    canary_requests=rollback.canary_requests,
                    canary_error_rate=rollback.canary_error_rate,
                    baseline_error_rate=rollback.baseline_error_rate,
                    canary_p50_s=rollback.canary_p50_s,
                    baseline_p50_s=rollback.baseline_p50_s,
                )

    def _breaker(self, dep: Deployment, error: BaseException | None, fault: bool) -> None:
        """An answer that rejects the caller's input proves the deployment alive: a success."""
        if not fault:
            self.breakers.on_success(dep.name)
        elif self.breakers.on_failure(dep.name):
            metrics.CIRCUIT_OPENED.labels(dep.name).inc()
            log.warning(
                "circuit_opened", deployment=dep.name, cooldown_s=self.breakers.cooldown_s, error=str(error)
            )
