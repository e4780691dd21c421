"""The attempt step: the healthy deployments a plan may use, and the one loop that tries them.

Every kind of work (tensors, embeddings, generations) runs through `Attempts.each`, so fallbacks,
circuit breakers, canary outcomes and service times are recorded the same way for all of them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Generic, NamedTuple, TypeVar

import structlog

from backends.base import Capability
from backends.errors import BackendTimeout, BackendUnavailable, InvalidInput
from gateway.core.fleet.deployments import Deployment
from gateway.core.fleet.outcomes import Outcomes
from gateway.observe import metrics
from router.health import CircuitBreakers
from router.planner import Plan

log = structlog.get_logger("gateway.core")

#: errors after which the next deployment of the plan is tried (nothing was sent to the caller yet)
RETRYABLE = (BackendUnavailable, BackendTimeout)

T = TypeVar("T")

#: what an attempt on one deployment returns: its result, its latency and its service time (s)
AttemptResult = tuple[T, float, float]


class Attempted(NamedTuple, Generic[T]):
    """The answer of the first deployment that gave one, and that deployment."""

    result: T
    deployment: Deployment


_KIND = {Capability.TENSOR: "tensors", Capability.GENERATE: "text generation", Capability.EMBED: "embeddings"}


class Attempts:
    """Chooses the candidates of a plan and runs the attempt loop over them."""

    def __init__(
        self,
        deployments: Mapping[str, Deployment],
        breakers: CircuitBreakers,
        outcomes: Outcomes,
        is_healthy: Callable[[str], bool],
    ) -> None:
        self._deployments = deployments
        self._breakers = breakers
        self._outcomes = outcomes
        self._is_healthy = is_healthy

    def candidates(self, plan: Plan, capability: Capability) -> list[Deployment]:
        """The plan's deployments, in order, that serve `capability` and are healthy now.

        Raises:
            InvalidInput: no deployment of the plan serves this kind of work (the wrong endpoint).
            BackendUnavailable: none of them is healthy now (retry after the breakers' cooldown).
        """
        chain = [self._deployments[d] for d in (plan.primary, *plan.fallbacks) if d in self._deployments]
        chain = [d for d in chain if capability in d.backend.capabilities]
        if not chain:
            raise InvalidInput(f"model {plan.model!r} does not serve {_KIND[capability]} on this endpoint")
        healthy = [d for d in chain if self._is_healthy(d.name)]
        if not healthy:
            raise BackendUnavailable(
                f"no healthy deployment for model {plan.model!r}", retry_after_s=self._breakers.cooldown_s
            )
        return healthy

    async def each(
        self,
        plan: Plan,
        candidates: list[Deployment],
        attempt: Callable[[Deployment], Awaitable[AttemptResult[T]]],
        caller_fault: Callable[[Deployment, BaseException], bool],
    ) -> Attempted[T]:
        """Try each candidate in order until one answers.

        A retryable error (the deployment is down or slow) moves on to the next candidate; any
        other error ends the loop, except an `InvalidInput` from a fallback after an outage (that
        fallback cannot take this request; the outage is the answer). Each attempt's outcome goes to
        the breakers, the canary watch and the service times; `caller_fault` says whether a refusal
        was the caller's own mistake (it must not count against a canary).
        """
        last_error: Exception | None = None
        # the plan's primary may be skipped (unhealthy, or unable to serve this kind of request):
        # the first candidate is then a fallback too, and counted as one
        came_from = plan.primary
        for index, dep in enumerate(candidates):
            if dep.name != came_from and came_from:
                metrics.FALLBACKS.labels(plan.model, came_from, dep.name).inc()
            came_from = dep.name
            self._breakers.on_attempt(dep.name)
            started = time.perf_counter()
            try:
                result, latency_s, service_s = await attempt(dep)
            except RETRYABLE as exc:
                self._outcomes.record(plan.model, dep, exc, time.perf_counter() - started)
                last_error = exc
                log.warning(
                    "deployment_failed", deployment=dep.name, error=str(exc), next=index + 1 < len(candidates)
                )
                continue
            except BaseException as exc:
                blame = caller_fault(dep, exc)
                self._outcomes.record(plan.model, dep, exc, time.perf_counter() - started, caller_fault=blame)
                if last_error is not None and isinstance(exc, InvalidInput):
                    # a fallback that cannot take this request (a remote's `tools` on the own
                    # engine, another signature) must not turn the outage before it into a 400
                    log.warning("fallback_refused_request", deployment=dep.name, error=str(exc))
                    continue
                raise
            self._outcomes.record(plan.model, dep, None, latency_s, service_s)
            return Attempted(result, dep)
        assert last_error is not None
        raise last_error


def any_fault(dep: Deployment, exc: BaseException) -> bool:
    """`caller_fault` for work that cannot be checked against another route cheaply (a prompt, an
    embedding input): a 4xx is taken as the caller's own and never counts against a canary."""
    return True
