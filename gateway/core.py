"""The request path, protocol-free: authenticate, route, admit, queue, serve, reconcile.

Protocol adapters (gateway/protocols/) decode a body into an internal request, call `infer` or
`generate` here, and encode what comes back. Everything a request goes through after decoding lives
in this one place, so the three wire protocols cannot drift apart in what they enforce.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from backends.base import Capability, GenerateRequest, TensorRequest, TensorResponse, TokenEvent, Usage
from backends.errors import BackendTimeout, BackendUnavailable, InvalidInput, ModelNotFound
from backends.validation import validate_request
from gateway import metrics
from gateway.config import Config
from gateway.deployments import Deployment
from gateway.outcomes import Outcomes
from gateway.queue_hints import NO_HINTS, QueueHints
from gateway.shadowing import Shadows
from gateway.streams import GenerationStream, StreamJob, estimate_text_tokens
from policies.admission import Admission, Reservation
from policies.errors import PolicyError, Unauthenticated
from policies.keys import KeyService
from policies.principal import Principal
from router.health import CircuitBreakers
from router.load import ServiceTimes, expected_wait
from router.planner import Plan, Router

log = structlog.get_logger(__name__)

#: errors after which the next deployment of the plan is tried (nothing was sent to the caller yet)
RETRYABLE = (BackendUnavailable, BackendTimeout)


@dataclass
class Served:
    """What the protocol adapter needs besides the payload: who served, and headers to send."""

    deployment: Deployment
    plan: Plan
    headers: dict[str, str] = field(default_factory=dict)


def extract_key(headers: Mapping[str, str]) -> str | None:
    """The API key from `Authorization: Bearer ...` or `x-api-key`."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    key = headers.get("x-api-key")
    return key.strip() if key else None


class GatewayCore:
    """Holds the live state of one gateway process and runs the request path."""

    def __init__(
        self,
        config: Config,
        deployments: dict[str, Deployment],
        router: Router,
        keys: KeyService,
        admission: Admission,
        breakers: CircuitBreakers | None = None,
        service_times: ServiceTimes | None = None,
    ) -> None:
        self.config = config
        self.deployments = deployments
        self.router = router
        self.keys = keys
        self.admission = admission
        self.breakers = breakers or CircuitBreakers()
        self.service_times = service_times or ServiceTimes()
        self.outcomes = Outcomes(self.breakers, router, self.service_times)
        self.shadows = Shadows(deployments)
        #: settlements of streams still running (held so that they are not garbage-collected)
        self.settling: set[asyncio.Future[None]] = set()

    # --- identity and visibility -----------------------------------------------------------

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        secret = extract_key(headers)
        if secret is None:
            raise Unauthenticated("missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")
        principal = await self.keys.authenticate(secret)
        if principal.tenant not in self.config.tenants:
            raise Unauthenticated("the API key belongs to a tenant that is no longer configured")
        return principal

    def can_see(self, principal: Principal, model: str) -> bool:
        tenant = self.config.tenants.get(principal.tenant)
        return tenant is not None and model in self.config.models and principal.can_see(model, tenant.models)

    def visible_models(self, principal: Principal) -> list[str]:
        return [m for m in self.router.names() if self.can_see(principal, m)]

    def check_visible(self, principal: Principal, model: str) -> None:
        """A model the caller may not see answers exactly like one that does not exist."""
        if not self.can_see(principal, model):
            raise ModelNotFound(f"model {model!r} does not exist")

    def ready(self) -> bool:
        """Whether probes should send traffic here (`server.readiness`).

        `any`: at least one deployment is loaded and warmed up (a gateway with no deployments, an
        admin-only front, is ready); `all`: every deployment is.
        """
        states = [d.ready for d in self.deployments.values()]
        if self.config.server.readiness == "all" or not states:
            return all(states)
        return any(states)

    def deployment_status(self) -> dict[str, dict[str, object]]:
        """Per deployment: ready, backend, device and its load error (operators only: names tenants' models)."""
        return {
            name: {"ready": d.ready, "backend": d.spec.backend, "device": d.device, "error": d.load_error}
            for name, d in self.deployments.items()
        }

    def is_healthy(self, deployment: str) -> bool:
        """Loaded, warmed up, and its circuit breaker lets requests through."""
        dep = self.deployments.get(deployment)
        return dep is not None and dep.ready and self.breakers.allows(deployment)

    def expected_wait(self, deployment: str) -> float:
        """Seconds until a new request would be done on `deployment` (see router.load)."""
        dep = self.deployments.get(deployment)
        if dep is None:
            return float("inf")
        queue = dep.queue
        return expected_wait(
            queue.depth(), queue.in_flight, queue.spec.max_concurrency, self.service_times.get(deployment)
        )

    def plan(
        self,
        principal: Principal,
        model: str,
        version: str | None,
        label: str | None,
        headers: Mapping[str, str],
    ) -> Plan:
        self.check_visible(principal, model)
        return self.router.plan(model, version=version, label=label, principal=principal, headers=headers)

    def check_room(self, principal: Principal, plan: Plan) -> None:
        """Refuse now (429/503) when the plan's first deployment has no queue room for this tenant.

        Called before the body is read: a flooding tenant whose queue is full costs the header
        parse and a cached key check, not the read, decode and admission of its body.
        """
        dep = self.deployments.get(plan.primary)
        if dep is not None:
            dep.queue.check_room(principal.tenant)

    def _candidates(self, plan: Plan, capability: Capability) -> list[Deployment]:
        chain = [self.deployments[d] for d in (plan.primary, *plan.fallbacks) if d in self.deployments]
        chain = [d for d in chain if capability in d.backend.capabilities]
        if not chain:
            kind = "tensors" if capability is Capability.TENSOR else "text generation"
            raise InvalidInput(f"model {plan.model!r} does not serve {kind} on this endpoint")
        healthy = [d for d in chain if self.is_healthy(d.name)]
        if not healthy:
            raise BackendUnavailable(
                f"no healthy deployment for model {plan.model!r}", retry_after_s=self.breakers.cooldown_s
            )
        return healthy

    # --- tensors ---------------------------------------------------------------------------

    async def infer(
        self, principal: Principal, plan: Plan, request: TensorRequest, hints: QueueHints = NO_HINTS
    ) -> tuple[TensorResponse, Served]:
        """Admit, queue and run a tensor request, falling back along the plan on retryable errors.

        `hints` (priority, queue deadline) apply in each deployment's fair queue it waits in.
        """
        candidates = self._candidates(plan, Capability.TENSOR)
        cost = request.batch_rows
        reservation = await self._admit(principal, plan.model, cost)
        used = 0
        try:
            last_error: Exception | None = None
            for index, dep in enumerate(candidates):
                if index:
                    metrics.FALLBACKS.labels(plan.model, candidates[index - 1].name, dep.name).inc()
                self.breakers.on_attempt(dep.name)
                started = time.perf_counter()
                try:
                    response, service_s = await self._run_queued(
                        principal, dep, cost, dep.backend.infer(request), hints
                    )
                except RETRYABLE as exc:
                    self.outcomes.record(plan.model, dep, exc, time.perf_counter() - started)
                    last_error = exc
                    log.warning(
                        "deployment_failed",
                        deployment=dep.name,
                        error=str(exc),
                        next=index + 1 < len(candidates),
                    )
                    continue
                except BaseException as exc:
                    blame = isinstance(exc, InvalidInput) and self._refused_by_every_route(plan, dep, request)
                    self.outcomes.record(
                        plan.model, dep, exc, time.perf_counter() - started, caller_fault=blame
                    )
                    raise
                self.outcomes.record(plan.model, dep, None, time.perf_counter() - started, service_s)
                used = cost
                self.shadows.mirror_tensor(plan, dep, request, response)
                served = Served(deployment=dep, plan=plan, headers=self.admission.headers(reservation))
                return response, served
            assert last_error is not None
            raise last_error
        finally:
            # a request that got no answer costs no usage and no request quota (README: what a
            # failure costs); its rate-limit slot stays spent, so failures cannot flood for free
            await self.admission.reconcile(reservation, used, failed=used == 0)

    def _refused_by_every_route(self, plan: Plan, refused_by: Deployment, request: TensorRequest) -> bool:
        """Whether the other routes of the model would refuse `request` too (the caller's mistake).

        Routes with the same input signature would refuse it the same way. A route whose signature
        differs (a canary with a new model) is asked: when it accepts the request, or when its input
        names differ so the request cannot be put to it, the refusal may be the deployment's own
        difference and counts against the refusing deployment.
        """
        model = self.config.models.get(plan.model)
        others = {r.deployment for r in model.routes} - {refused_by.name} if model else set()
        mine = refused_by.backend.metadata().inputs
        for name in others:
            dep = self.deployments.get(name)
            if dep is None or not dep.ready or Capability.TENSOR not in dep.backend.capabilities:
                continue
            meta = dep.backend.metadata()
            if meta.inputs == mine:
                continue
            if {s.name for s in meta.inputs} != {s.name for s in mine}:
                return False
            try:
                validate_request(request, meta)
            except InvalidInput:
                continue
            return False
        return True

    async def _run_queued(
        self, principal: Principal, dep: Deployment, cost: float, work: Any, hints: QueueHints
    ) -> tuple[Any, float]:
        """Wait for a turn in the deployment's fair queue, then await `work` (a coroutine).

        Returns its result and the seconds it took once it had its turn (the service time).
        """
        queued_at = time.perf_counter()
        try:
            ticket = await dep.queue.acquire(
                principal.tenant, cost, priority=hints.priority, timeout_s=hints.timeout_s
            )
        except BaseException:
            work.close()  # never awaited: close it so Python does not warn
            raise
        granted = time.perf_counter()
        metrics.QUEUE_TIME.labels(dep.name, principal.tenant).observe(granted - queued_at)
        try:
            return await work, time.perf_counter() - granted
        finally:
            dep.queue.release(ticket, cost)

    async def _admit(self, principal: Principal, model: str, cost: int) -> Reservation:
        """Admit in a task of its own: a caller cancelled meanwhile (deadline, disconnect) cannot
        leave a reservation the store granted without anyone to settle it."""
        task = asyncio.ensure_future(self.admission.admit(principal, model, cost))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._settle_abandoned)
            raise
        except PolicyError as exc:
            metrics.REJECTIONS.labels(principal.tenant, exc.code).inc()
            raise

    def _settle_abandoned(self, task: asyncio.Future[Reservation]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        settle = asyncio.ensure_future(self.admission.reconcile(task.result(), 0, failed=True))
        self.settling.add(settle)
        settle.add_done_callback(self.settling.discard)

    # --- text generation -------------------------------------------------------------------

    async def estimate_prompt_tokens(self, plan: Plan, request: GenerateRequest) -> int:
        """Prompt tokens to reserve at admission: exact where the backend has a tokenizer.

        Remote upstreams tokenize on their side, so a conservative estimate (about four bytes per
        token) is reserved and the upstream's real count settles it when the answer ends.
        """
        dep = self.deployments.get(plan.primary)
        counter = getattr(dep.backend, "count_prompt_tokens", None) if dep else None
        if counter is not None:
            return int(await counter(request))
        if request.prompt_token_ids is not None:
            return len(request.prompt_token_ids)
        text = request.prompt or "".join(m.content for m in request.messages or [])
        return max(1, estimate_text_tokens(text) + 4 * len(request.messages or []))

    async def start_generation(
        self,
        principal: Principal,
        plan: Plan,
        request: GenerateRequest,
        prompt_tokens: int,
        hints: QueueHints = NO_HINTS,
    ) -> tuple[GenerationStream, Served]:
        """Admit and start a generation; returns the stream once the first event is in hand.

        The caller must iterate the stream to its end or `aclose()` it: either settles the queue
        ticket and the admission reservation (see `GenerationStream`).

        The first event is awaited here so that a deployment that fails before producing anything
        can still be replaced by the next one in the plan, and so that errors before the first
        token reach the caller as a proper HTTP error instead of a broken stream.
        """
        candidates = self._candidates(plan, Capability.GENERATE)
        reservation = await self._admit(principal, plan.model, prompt_tokens + request.sampling.max_tokens)
        last_error: Exception | None = None
        for index, dep in enumerate(candidates):
            if index:
                metrics.FALLBACKS.labels(plan.model, candidates[index - 1].name, dep.name).inc()
            try:
                ticket = await dep.queue.acquire(
                    principal.tenant,
                    prompt_tokens + request.sampling.max_tokens,
                    priority=hints.priority,
                    timeout_s=hints.timeout_s,
                )
            except BaseException:
                await self.admission.reconcile(reservation, 0, failed=True)
                raise
            self.breakers.on_attempt(dep.name)
            started = time.perf_counter()
            stream = dep.backend.generate(request)
            try:
                first = await anext(stream)
            except StopAsyncIteration:
                first = TokenEvent(request_id=request.request_id, finish_reason="stop", usage=Usage())
            except RETRYABLE as exc:
                self.outcomes.record(plan.model, dep, exc, time.perf_counter() - started)
                dep.queue.release(ticket, 0)
                last_error = exc
                log.warning("deployment_failed", deployment=dep.name, error=str(exc))
                continue
            except BaseException as exc:
                # a prompt cannot be checked against another route cheaply: a generation's 4xx is
                # taken as the caller's own and never counts against a canary
                self.outcomes.record(
                    plan.model, dep, exc, time.perf_counter() - started, caller_fault=True
                )
                dep.queue.release(ticket, 0)
                await self.admission.reconcile(reservation, 0, failed=True)
                raise
            # A stream's latency and service time are its time to first event: the rest of it runs
            # at the pace the client reads, which says nothing about the deployment's load.
            first_event_s = time.perf_counter() - started
            self.outcomes.record(plan.model, dep, None, first_event_s, first_event_s)
            served = Served(deployment=dep, plan=plan, headers=self.admission.headers(reservation))
            job = StreamJob(principal, plan, dep, request, ticket, reservation, prompt_tokens)
            return GenerationStream(self, job, stream, first), served
        await self.admission.reconcile(reservation, 0, failed=True)
        assert last_error is not None
        raise last_error
