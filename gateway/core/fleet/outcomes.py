"""What one attempt on a deployment teaches the gateway: breaker state, canary watch, service time."""

from __future__ import annotations

import structlog

from backends.errors import (
    BackendInternalError,
    BackendTimeout,
    BackendUnavailable,
    InvalidInput,
    ModelNotFound,
)
from gateway.core.fleet.deployments import Deployment
from gateway.observe import metrics
from router.health import CircuitBreakers
from router.load import ServiceTimes
from router.planner import Router

log = structlog.get_logger(__name__)

#: errors that count against a deployment (breaker, canary); the caller's own mistakes do not
DEPLOYMENT_FAULTS = (BackendUnavailable, BackendTimeout, BackendInternalError)
#: answers of the deployment that refuse the caller's request (4xx): the deployment is alive, and a
#: canary that gives many more of them than its baseline is rolled back (`router.canary`)
CALLER_ERRORS = (InvalidInput, ModelNotFound)


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
        *,
        caller_fault: bool = False,
    ) -> None:
        """Record one attempt.

        Args:
            model: the logical model the attempt served (canaries are judged per model).
            dep: the deployment tried.
            error: what it raised, or None.
            latency_s: the attempt as the caller saw it (queue wait included; first event for streams).
            service_s: the backend's own time, for the load estimate (successes only).
            caller_fault: the refusal (4xx) was the caller's own mistake, one every route of the
                model would make too: it says nothing about this deployment, so the canary watch
                does not see it (one tenant's bad requests must not roll a canary back for all).
        """
        fault = isinstance(error, DEPLOYMENT_FAULTS)
        answered = error is None or isinstance(error, CALLER_ERRORS)
        self._breaker(dep, error, fault, answered)
        if error is None and service_s is not None:
            self.service_times.observe(dep.name, service_s)
        # Anything else (queue full, queue deadline, the caller left) never reached the deployment
        # or got no answer from it: it says nothing about the canary either way.
        if caller_fault and isinstance(error, CALLER_ERRORS):
            return
        if (answered or fault) and self.router.canaries.watches(model):
            rollback = self.router.canaries.record(
                model, dep.name, not fault, latency_s, caller_error=error is not None and not fault
            )
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
                    canary_caller_error_rate=rollback.canary_caller_error_rate,
                    baseline_caller_error_rate=rollback.baseline_caller_error_rate,
                    canary_p50_s=rollback.canary_p50_s,
                    baseline_p50_s=rollback.baseline_p50_s,
                )

    def _breaker(self, dep: Deployment, error: BaseException | None, fault: bool, answered: bool) -> None:
        """Only an answer closes a circuit: a success, or one that rejects the caller's request.

        A non-answer (queue full, queue deadline, cancelled because the caller left) must not close
        a half-open circuit on a dead deployment; it only frees the probe slot for the next request.
        """
        if fault:
            if self.breakers.on_failure(dep.name):
                metrics.CIRCUIT_OPENED.labels(dep.name).inc()
                log.warning(
                    "circuit_opened",
                    deployment=dep.name,
                    cooldown_s=self.breakers.cooldown_s,
                    error=str(error),
                )
        elif answered:
            self.breakers.on_success(dep.name)
        else:
            self.breakers.on_no_answer(dep.name)
