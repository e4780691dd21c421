"""The request path, protocol-free: authenticate, route, admit, queue, serve, reconcile, record.

A protocol adapter (gateway/protocols/, a gRPC servicer, a test double) turns its wire request into
a `Call` (protocol, credential, metadata) and asks the core for one thing: `serve_tensors`,
`serve_generation`, `model_view` or `visible_models`. Everything after that happens here in one
pass (authenticate, plan, check room, read and decode the payload through the adapter's loader,
estimate, admit, queue, attempt with fallbacks, settle, record), so the protocols cannot drift apart
in what they enforce, and an adapter never calls the router itself. The adapter encodes the
outcome it gets back, or the exception, in its own protocol.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import msgspec
import numpy as np
import structlog

from backends.base import (
    Capability,
    EmbedRequest,
    GenerateRequest,
    ModelMetadata,
    TensorRequest,
    TensorResponse,
    TokenEvent,
    Usage,
    as_generative,
    as_tensor,
    estimate_prompt_tokens,
)
from backends.embedding import as_embedding_adapter
from backends.errors import BackendTimeout, BackendUnavailable, InvalidInput, ModelNotFound
from backends.validation import validate_request
from fleetgate import tracing
from gateway import metrics
from gateway.calls import Call, ModelRef
from gateway.config import Config
from gateway.deadline import Deadline
from gateway.deployments import Deployment, FleetSignals
from gateway.drain import DrainState
from gateway.errors import GatewayError
from gateway.graph_runner import GraphRunner
from gateway.lora_models import base_model_of, declared_adapters, served_models
from gateway.outcomes import Outcomes
from gateway.queue_hints import BACKGROUND_HINTS, NO_HINTS, QueueHints, queue_hints
from gateway.row_slices import CONTINUING_PRIORITY, join_row_slices, row_slices
from gateway.shadowing import Shadows
from gateway.streams import ChoiceShare, GenerationStream, StreamJob, StreamSettlement
from policies.admission import Admission, Reservation
from policies.errors import PolicyError, Unauthenticated
from policies.keys import KeyService
from policies.principal import Principal
from router.health import CircuitBreakers
from router.load import ServiceTimes
from router.planner import Plan, Router
from router.spec import ModelConfig

log = structlog.get_logger(__name__)

#: errors after which the next deployment of the plan is tried (nothing was sent to the caller yet)
RETRYABLE = (BackendUnavailable, BackendTimeout)

T = TypeVar("T")


@dataclass
class Served:
    """Who served a call, and the headers (or gRPC trailing metadata) its answer carries."""

    #: None for a graph, whose steps each have theirs (`description` names them)
    deployment: Deployment | None
    plan: Plan
    headers: dict[str, str] = field(default_factory=dict)
    description: str = ""

    def response_headers(self, call: Call) -> dict[str, str]:
        """The admission headers plus the deployment that served and the call's request id."""
        served_by = self.deployment.served_by() if self.deployment is not None else self.description
        return {**self.headers, "x-fleetgate-deployment": served_by, "x-request-id": call.echo_id}


class DecodedTensors(Protocol):
    """What an adapter's tensor loader returns: its decoded payload, carrying the internal request."""

    @property
    def request(self) -> TensorRequest: ...


D = TypeVar("D", bound=DecodedTensors)


@dataclass
class TensorOutcome(Generic[D]):
    """A served tensor call: the adapter's decoded payload (for encoding), the answer, who served."""

    decoded: D
    response: TensorResponse
    served: Served


@dataclass
class GenerationInput:
    """What an adapter's generation loader returns: the model named in the payload, and how to
    build the internal request (built after routing, so an unknown model is refused first)."""

    model: ModelRef
    build: Callable[[], GenerateRequest]
    #: the decoded payload, handed back to the adapter for encoding
    body: Any = None
    #: choices to generate for the same prompt (OpenAI `n`), admitted together
    n: int = 1


class NamesModel(Protocol):
    """A decoded payload that names its model (generation and embeddings inputs)."""

    @property
    def model(self) -> ModelRef: ...


P = TypeVar("P", bound=NamesModel)


@dataclass
class StartedGeneration:
    """A started generation: its events (iterate to the end or `aclose()`), who serves it, the
    payload the adapter decoded, and the call's deadline for waiting on each event."""

    stream: GenerationStream
    served: Served
    body: Any
    deadline: Deadline
    #: every choice's stream (OpenAI `n`); `stream` is the first
    streams: list[GenerationStream] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.streams:
            self.streams = [self.stream]


@dataclass
class EmbeddingsInput:
    """What an adapter's embeddings loader returns: the model, the inputs, the decoded payload."""

    model: ModelRef
    inputs: list[str] | list[list[int]]
    body: Any = None
    #: keep the first N components of each vector (checked against the model before admission)
    dimensions: int | None = None


@dataclass
class EmbeddingsOutcome:
    """A served embeddings call: one vector per input, the tokens it cost, who served it."""

    vectors: np.ndarray
    tokens: int
    served: Served
    body: Any


@dataclass
class ModelView:
    """What metadata and readiness endpoints show of a model, for one caller."""

    name: str
    version: str | None
    versions: list[str]
    #: the deployment that would serve (None for a graph: `describe` derives its metadata)
    deployment: Deployment | None
    #: whether any deployment of the plan can take a request now
    ready: bool
    describe: Callable[[], ModelMetadata] | None = None

    def metadata(self) -> ModelMetadata:
        """The serving deployment's metadata (raises BackendUnavailable before it is loaded)."""
        if self.describe is not None:
            return self.describe()
        assert self.deployment is not None
        return self.deployment.backend.metadata()


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
        self.signals = FleetSignals(deployments, self.breakers, self.service_times)
        self.outcomes = Outcomes(self.breakers, router, self.service_times)
        self.shadows = Shadows(deployments)
        #: what a running stream needs at its end (and the settlements still running)
        self.settlement = StreamSettlement(admission, self.shadows)
        #: the process's drain after SIGTERM (gateway/drain.py): not ready, then refusing new calls
        self.drain = DrainState()
        #: LoRA adapters served as models: model name -> the deployment of its base (gateway/adapters.py)
        self.adapter_models: dict[str, str] = declared_adapters(config)
        #: the config's `graphs:`, served as models (gateway/graph_runner.py)
        self.graphs = GraphRunner(self)

    def served_models(self, config: Config | None = None) -> dict[str, ModelConfig]:
        """The models the router knows: the config's `models:` plus one per LoRA adapter."""
        return served_models(config or self.config, self.adapter_models)

    @classmethod
    def assemble(
        cls,
        config: Config,
        deployments: dict[str, Deployment],
        keys: KeyService,
        admission: Admission,
        breakers: CircuitBreakers,
        service_times: ServiceTimes,
    ) -> GatewayCore:
        """The core with its router, wired to the same breakers and service times (no cycle)."""
        signals = FleetSignals(deployments, breakers, service_times)
        models = served_models(config, declared_adapters(config))
        router = Router(models, is_healthy=signals.is_healthy, expected_wait=signals.expected_wait)
        return cls(config, deployments, router, keys, admission, breakers, service_times)

    # --- the one-pass API for protocol adapters ------------------------------------------------

    async def identify(self, call: Call) -> Principal:
        """Authenticate the call's credential; the tenant is recorded on the call.

        Every call of every protocol starts here, so a draining process refuses new work here.
        """
        if self.drain.refusing:
            raise GatewayError(
                503,
                "shutting_down",
                "this gateway instance is shutting down; retry (another instance will answer)",
                headers={"Retry-After": "1"},
            )
        if call.principal is not None:  # made by the gateway itself (a batch line), already known
            principal = call.principal
        elif call.api_key is None:
            raise Unauthenticated("missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`")
        else:
            with tracing.child("authenticate"):
                principal = await self.keys.authenticate(call.api_key)
        if principal.tenant not in self.config.tenants:
            raise Unauthenticated("the API key belongs to a tenant that is no longer configured")
        call.tenant = principal.tenant
        return principal

    async def serve_tensors(
        self, call: Call, model: ModelRef, load: Callable[[ModelMetadata], Awaitable[D]]
    ) -> TensorOutcome[D]:
        """Serve one tensor call: authenticate, route, refuse early when the queue is full, then
        read and decode the payload (`load`, given the first candidate deployment's metadata), admit, queue,
        run with fallbacks, settle and record. All of it under the call's deadline."""
        call.model = model.name
        with tracing.span(
            "fleetgate.request", tracing.extract_context(call.headers), **_call_attributes(call)
        ) as span:
            return await self._serve_tensors(call, model, load, span)

    async def _serve_tensors(
        self, call: Call, model: ModelRef, load: Callable[[ModelMetadata], Awaitable[D]], span: Any
    ) -> TensorOutcome[D]:
        principal = await self.identify(call)
        if model.name in self.config.graphs:
            return await self._serve_graph(call, principal, model, load, span)
        plan = self.plan(principal, model.name, model.version, model.label, call.headers)
        self.check_room(principal, plan)
        async with self.deadline(call).scope():
            # decoded against the first deployment that will be tried (TF Serving's row form
            # needs its signature); one that is down is skipped as `infer` skips it
            decoded = await load(self._candidates(plan, Capability.TENSOR)[0].backend.metadata())
            response, served = await self.infer(principal, plan, decoded.request, _hints(call))
        self._record_server(call, served, span)
        return TensorOutcome(decoded, response, served)

    async def _serve_graph(
        self,
        call: Call,
        principal: Principal,
        model: ModelRef,
        load: Callable[[ModelMetadata], Awaitable[D]],
        span: Any,
    ) -> TensorOutcome[D]:
        """A graph request: checked against the graph's inputs, admitted and charged once for the
        graph, its steps run (gateway/graph_runner.py), and usage recorded per step beside it."""
        self.check_visible(principal, model.name)
        _graph_version(model)
        async with self.deadline(call).scope():
            meta = self.graphs.metadata(model.name)
            decoded = await load(meta)
            validate_request(decoded.request, meta)
            cost = decoded.request.batch_rows
            hints = _hints(call)  # a bad hint header is refused before it costs a rate-limit slot
            reservation = await self._admit(principal, model.name, cost)
            try:
                result = await self.graphs.run(principal, model.name, decoded.request, hints, call.headers)
            except BaseException:
                await self.admission.reconcile(reservation, 0, failed=True)
                raise
            parts = {f"{model.name}/{step}": rows for step, rows in result.rows.items()}
            await self.admission.reconcile(reservation, cost, parts=parts)
        plan = Plan(model=model.name, primary="", fallbacks=(), shadows=())
        served = Served(None, plan, self.admission.headers(reservation), result.description(model.name))
        self._record_server(call, served, span)
        return TensorOutcome(decoded, result.response, served)

    async def serve_generation(
        self, call: Call, load: Callable[[], Awaitable[GenerationInput]]
    ) -> StartedGeneration:
        """Start one generation: authenticate, read and decode the payload (`load`: the model is
        named in it), route, refuse early when the queue is full, build the request, count the
        prompt, admit, queue and start with fallbacks. The caller iterates the returned stream to
        its end or closes it; either settles the reservation and the queue."""
        # the request's span ends when its stream settles (GenerationStream), not here
        span = tracing.start_span(
            "fleetgate.request", tracing.extract_context(call.headers), **_call_attributes(call)
        )
        try:
            with tracing.current(span):
                principal, deadline, given, plan = await self._payload_call(call, load)
                request = given.build()
                request.tenant = principal.tenant
                request.adapter = plan.model if plan.model in self.adapter_models else None
                async with deadline.scope():
                    prompt_tokens = await self.estimate_prompt_tokens(plan, request)
                    hints = _hints(call)
                    if given.n == 1:
                        stream, served = await self.start_generation(
                            principal, plan, request, prompt_tokens, hints, span
                        )
                        streams = [stream]
                    else:
                        streams, served = await self._start_choices(
                            principal, plan, request, prompt_tokens, given.n, hints, span
                        )
        except BaseException as exc:
            _end_span(span, exc)
            raise
        self._record_server(call, served, span)
        return StartedGeneration(streams[0], served, given.body, deadline, streams)

    async def _start_choices(
        self,
        principal: Principal,
        plan: Plan,
        request: GenerateRequest,
        prompt_tokens: int,
        n: int,
        hints: QueueHints,
        span: Any,
    ) -> tuple[list[GenerationStream], Served]:
        """Start `n` choices of one prompt on one deployment: one admission and one fair-queue turn
        for all of them (settled once by `ChoiceShare`), then one engine request per choice (the
        engine queues those beyond its free slots and shares the prompt's KV blocks). A seeded
        request gives choice i the seed + i. When a choice cannot start, the started ones are closed
        and all `n` move to the plan's next deployment, as a single request would (the choices of one
        answer always come from one deployment)."""
        candidates = self._candidates(plan, Capability.GENERATE)
        cost = n * (prompt_tokens + request.sampling.max_tokens)
        reservation = await self._admit(principal, plan.model, cost)
        share = ChoiceShare(self.admission, reservation, n, span)

        async def attempt(dep: Deployment) -> tuple[list[GenerationStream], float, float]:
            with tracing.child("queue", **{"fleetgate.deployment": dep.name}):
                ticket = await dep.queue.acquire(
                    principal.tenant,
                    cost,
                    priority=hints.priority,
                    timeout_s=hints.timeout_s,
                    background=hints.background,
                )
            share.begin_attempt(dep.queue, ticket)
            started = time.perf_counter()
            streams: list[GenerationStream] = []
            try:
                for i in range(n):
                    choice = _choice_request(request, i)
                    events = as_generative(dep.backend).generate(choice)
                    first = await _first_event(events, choice.request_id)
                    job = StreamJob(
                        principal, plan, dep, choice, share.choice_ticket(), reservation, prompt_tokens,
                        None, share,
                    )  # fmt: skip
                    streams.append(GenerationStream(self.settlement, job, events, first))
            except BaseException:
                for stream in streams:
                    await stream.aclose()
                share.abandon_attempt()
                raise
            first_event_s = time.perf_counter() - started
            return streams, first_event_s, first_event_s

        try:
            streams, dep = await self._attempt_each(plan, candidates, attempt, lambda dep, exc: True)
        except BaseException:
            await share.fail()
            raise
        return streams, Served(deployment=dep, plan=plan, headers=self.admission.headers(reservation))

    async def serve_embeddings(
        self, call: Call, load: Callable[[], Awaitable[EmbeddingsInput]]
    ) -> EmbeddingsOutcome:
        """Serve one embeddings call: authenticate, read and decode the payload, route, refuse early
        when the queue is full, check the inputs' count and bytes, admit on an estimate, tokenize
        (off the event loop when large), queue, embed with fallbacks, settle by the real tokens
        (charged to token limits and quotas; the fair queue's cost), record."""
        with tracing.span(
            "fleetgate.request", tracing.extract_context(call.headers), **_call_attributes(call)
        ) as span:
            return await self._serve_embeddings(call, load, span)

    async def _serve_embeddings(
        self, call: Call, load: Callable[[], Awaitable[EmbeddingsInput]], span: Any
    ) -> EmbeddingsOutcome:
        principal, deadline, given, plan = await self._payload_call(call, load)
        candidates = self._candidates(plan, Capability.EMBED)
        first = as_embedding_adapter(candidates[0].backend)
        # checked (count, bytes, ids, dimensions) and admitted on an estimate before any tokenizing:
        # a refused or oversized call costs no tokenizer time; it is charged its real tokens
        text_bytes = first.check_embedding(given.inputs, given.dimensions)
        hints = _hints(call)
        async with deadline.scope():
            reservation = await self._admit(principal, plan.model, first.estimate_tokens(given.inputs))
            used = 0
            try:
                request = await first.tokenize_embedding(
                    given.inputs, call.request_id, given.dimensions, text_bytes
                )

                async def attempt(dep: Deployment) -> tuple[tuple[EmbedRequest, np.ndarray], float, float]:
                    started = time.perf_counter()
                    backend = as_embedding_adapter(dep.backend)
                    tokens = request
                    if dep is not candidates[0]:  # another encoder: its own checks and tokenizer
                        size = backend.check_embedding(given.inputs, given.dimensions)
                        tokens = await backend.tokenize_embedding(
                            given.inputs, call.request_id, given.dimensions, size
                        )
                    vectors, service_s = await self._run_queued(
                        principal, dep, tokens.tokens, backend.embed(tokens), hints
                    )
                    return (tokens, vectors), time.perf_counter() - started, service_s

                (served_request, vectors), dep = await self._attempt_each(
                    plan, candidates, attempt, lambda dep, exc: True
                )
                used = served_request.tokens
            finally:
                await self.admission.reconcile(reservation, used, failed=used == 0)
        served = Served(deployment=dep, plan=plan, headers=self.admission.headers(reservation))
        self._record_server(call, served, span)
        return EmbeddingsOutcome(vectors, used, served, given.body)

    async def _payload_call(
        self, call: Call, load: Callable[[], Awaitable[P]]
    ) -> tuple[Principal, Deadline, P, Plan]:
        """The first steps of a call whose model is named in its payload: authenticate, read and
        decode the payload under the call's deadline, route, and refuse at once when the queue of
        the first deployment has no room for the tenant (before tokenizing or admission)."""
        principal = await self.identify(call)
        deadline = self.deadline(call)
        async with deadline.scope():
            given = await load()
        call.model = given.model.name
        plan = self.plan(principal, given.model.name, given.model.version, given.model.label, call.headers)
        self.check_room(principal, plan)
        return principal, deadline, given, plan

    async def model_view(self, call: Call, model: ModelRef) -> ModelView:
        """A model as the caller may see it (metadata, versions, readiness)."""
        call.model = model.name
        principal = await self.identify(call)
        if model.name in self.config.graphs:
            self.check_visible(principal, model.name)
            _graph_version(model)
            name = model.name
            return ModelView(name, None, [], None, self.graphs.ready(name), lambda: self.graphs.metadata(name))
        plan = self.plan(principal, model.name, model.version, model.label, call.headers)
        return ModelView(
            name=model.name,
            version=plan.version,
            versions=self.router.versions(model.name),
            deployment=self.deployments[plan.primary],
            ready=any(self.is_healthy(d) for d in (plan.primary, *plan.fallbacks)),
        )

    def version_states(self, model: str, version: str | None) -> list[tuple[str | None, bool]]:
        """(version, whether it can serve) for `version`, or for every version of `model`."""
        if model in self.config.graphs:
            return [(None, self.graphs.ready(model))]
        spec = self.router.get(model)
        versions = [version] if version is not None else (sorted(spec.versions) or [None])
        out = []
        for v in versions:
            names = [spec.versions[v]] if v is not None else [r.deployment for r in spec.routes]
            out.append((v, any(self.is_healthy(d) for d in names)))
        return out

    def deadline(self, call: Call) -> Deadline:
        """The call's end-to-end deadline (`server.request_timeout_s`, from its start)."""
        return Deadline(self.config.server.request_timeout_s, call.started)

    @staticmethod
    def _record_server(call: Call, served: Served, span: Any = None) -> None:
        dep = served.deployment
        # a graph has no one deployment: its steps' are in its response header (and their spans)
        name, backend = (dep.name, dep.spec.backend) if dep is not None else ("", "graph")
        call.served_by(name, backend, dep.device if dep is not None else "")
        if span is not None:
            span.set_attributes(
                {
                    "fleetgate.tenant": call.tenant,
                    "fleetgate.model": call.model,
                    "fleetgate.deployment": name,
                    "fleetgate.backend": backend,
                }
            )

    # --- identity and visibility -----------------------------------------------------------

    def can_see(self, principal: Principal, model: str) -> bool:
        tenant = self.config.tenants.get(principal.tenant)
        known = model in self.config.models or model in self.adapter_models or model in self.config.graphs
        return tenant is not None and known and principal.can_see(model, tenant.models)

    def adapter_parent(self, model: str) -> str | None:
        """The base model of a LoRA adapter model (None for other models)."""
        deployment = self.adapter_models.get(model)
        return None if deployment is None else base_model_of(self.config, deployment)

    def visible_models(self, principal: Principal) -> list[str]:
        names = sorted({*self.router.names(), *self.config.graphs})
        return [m for m in names if self.can_see(principal, m)]

    def check_visible(self, principal: Principal, model: str) -> None:
        """A model the caller may not see answers exactly like one that does not exist."""
        if not self.can_see(principal, model):
            raise ModelNotFound(f"model {model!r} does not exist")

    def ready(self) -> bool:
        """Whether probes should send traffic here (`server.readiness`).

        `any`: at least one deployment is loaded and warmed up (a gateway with no deployments, an
        admin-only front, is ready); `all`: every deployment is.
        """
        if self.drain.draining:
            return False
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
        return self.signals.is_healthy(deployment)

    def expected_wait(self, deployment: str) -> float:
        """Seconds until a new request would be done on `deployment` (see router.load)."""
        return self.signals.expected_wait(deployment)

    # --- the steps ---------------------------------------------------------------------------

    def plan(
        self,
        principal: Principal,
        model: str,
        version: str | None,
        label: str | None,
        headers: dict[str, str] | Any,
    ) -> Plan:
        self.check_visible(principal, model)
        if model in self.config.graphs:  # graphs are served by `serve_tensors` and `model_view` only
            raise InvalidInput(
                f"model {model!r} is a graph of tensor models; call it on the v2 or TF Serving endpoints"
            )
        with tracing.child("route"):
            return self.router.plan(model, version=version, label=label, principal=principal, headers=headers)

    def check_room(self, principal: Principal, plan: Plan) -> None:
        """Refuse now (429/503) when the plan's first deployment has no queue room for this tenant.

        Called before the body is read: a flooding tenant whose queue is full costs the header
        parse and a cached key check, not the read, decode and admission of its body.
        """
        dep = self.deployments.get(plan.primary)
        # a batch job's line waits in the background class, which has no bound of its own (the job
        # paces itself); the tenant's full interactive queue says nothing about it
        if dep is not None and principal.background is None:
            dep.queue.check_room(principal.tenant)

    def _candidates(self, plan: Plan, capability: Capability) -> list[Deployment]:
        chain = [self.deployments[d] for d in (plan.primary, *plan.fallbacks) if d in self.deployments]
        chain = [d for d in chain if capability in d.backend.capabilities]
        if not chain:
            kind = {Capability.TENSOR: "tensors", Capability.GENERATE: "text generation"}.get(
                capability, "embeddings"
            )
            raise InvalidInput(f"model {plan.model!r} does not serve {kind} on this endpoint")
        healthy = [d for d in chain if self.is_healthy(d.name)]
        if not healthy:
            raise BackendUnavailable(
                f"no healthy deployment for model {plan.model!r}", retry_after_s=self.breakers.cooldown_s
            )
        return healthy

    async def _attempt_each(
        self,
        plan: Plan,
        candidates: list[Deployment],
        attempt: Callable[[Deployment], Awaitable[tuple[T, float, float]]],
        caller_fault: Callable[[Deployment, BaseException], bool],
    ) -> tuple[T, Deployment]:
        """The one attempt loop: try each candidate in order until one answers.

        `attempt(dep)` returns (result, latency_s, service_s) as the caller sees them. A retryable
        error (unavailable, timeout: nothing reached the caller yet) moves on to the next candidate;
        any other error ends the loop. Every attempt's outcome feeds the breakers, the canary watch
        and the service-time estimate; `caller_fault` says whether a refusal was the caller's own
        mistake (which must not count against a canary).
        """
        last_error: Exception | None = None
        # the plan's primary may be skipped (unhealthy, or unable to serve this kind of request):
        # the first candidate is then a fallback too, and counted as one
        came_from = plan.primary
        for index, dep in enumerate(candidates):
            if dep.name != came_from and came_from:
                metrics.FALLBACKS.labels(plan.model, came_from, dep.name).inc()
            came_from = dep.name
            self.breakers.on_attempt(dep.name)
            started = time.perf_counter()
            try:
                result, latency_s, service_s = await attempt(dep)
            except RETRYABLE as exc:
                self.outcomes.record(plan.model, dep, exc, time.perf_counter() - started)
                last_error = exc
                log.warning(
                    "deployment_failed", deployment=dep.name, error=str(exc), next=index + 1 < len(candidates)
                )
                continue
            except BaseException as exc:
                blame = caller_fault(dep, exc)
                self.outcomes.record(plan.model, dep, exc, time.perf_counter() - started, caller_fault=blame)
                if last_error is not None and isinstance(exc, InvalidInput):
                    # a fallback that cannot take this request (a remote's `tools` on the own
                    # engine, another signature) must not turn the outage before it into a 400
                    log.warning("fallback_refused_request", deployment=dep.name, error=str(exc))
                    continue
                raise
            self.outcomes.record(plan.model, dep, None, latency_s, service_s)
            return result, dep
        assert last_error is not None
        raise last_error

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
            response, dep = await self.run_tensors(principal, plan, request, hints, candidates)
            used = cost
        finally:
            # a request that got no answer costs no usage and no request quota (README: what a
            # failure costs); its rate-limit slot stays spent, so failures cannot flood for free
            await self.admission.reconcile(reservation, used, failed=used == 0)
        return response, Served(deployment=dep, plan=plan, headers=self.admission.headers(reservation))

    async def run_tensors(
        self,
        principal: Principal,
        plan: Plan,
        request: TensorRequest,
        hints: QueueHints = NO_HINTS,
        candidates: list[Deployment] | None = None,
    ) -> tuple[TensorResponse, Deployment]:
        """Queue and run an admitted tensor request on the plan's deployments, falling back on
        retryable errors; returns the answer and the deployment that gave it. The caller admitted
        and settles it (`infer`; a graph admits once for all its steps)."""
        if candidates is None:
            candidates = self._candidates(plan, Capability.TENSOR)
        cost = request.batch_rows

        async def attempt(dep: Deployment) -> tuple[TensorResponse, float, float]:
            started = time.perf_counter()
            slices = row_slices(request, dep.queue.spec.split_rows, dep.backend.metadata())
            if slices is None:
                work = as_tensor(dep.backend).infer(request)
                response, service_s = await self._run_queued(principal, dep, cost, work, hints)
            else:
                response, service_s = await self._run_in_slices(principal, dep, slices, hints)
            return response, time.perf_counter() - started, service_s

        def caller_fault(dep: Deployment, exc: BaseException) -> bool:
            return isinstance(exc, InvalidInput) and self._refused_by_every_route(plan, dep, request)

        response, dep = await self._attempt_each(plan, candidates, attempt, caller_fault)
        self.shadows.mirror_tensor(plan, dep, request, response)
        return response, dep

    async def _run_in_slices(
        self, principal: Principal, dep: Deployment, slices: list[TensorRequest], hints: QueueHints
    ) -> tuple[TensorResponse, float]:
        """Run a large request slice by slice, each slice taking its own turn in the fair queue
        (`queue.split_rows`); the outputs are joined along dimension 0. Later slices go first among
        their own tenant's requests (a started request finishes before the tenant's next one)."""
        backend = as_tensor(dep.backend)
        continuing = QueueHints(priority=CONTINUING_PRIORITY, timeout_s=hints.timeout_s)
        parts: list[TensorResponse] = []
        service_s = 0.0
        for index, part in enumerate(slices):
            work = backend.infer(part)
            answer, seconds = await self._run_queued(
                principal, dep, part.batch_rows, work, hints if index == 0 else continuing, index > 0
            )
            parts.append(answer)
            service_s += seconds
        return join_row_slices(slices[0].id, parts), service_s

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
        self,
        principal: Principal,
        dep: Deployment,
        cost: float,
        work: Any,
        hints: QueueHints,
        continuing: bool = False,
    ) -> tuple[Any, float]:
        """Wait for a turn in the deployment's fair queue, then await `work` (a coroutine).

        Returns its result and the seconds it took once it had its turn (the service time).
        """
        queued_at = time.perf_counter()
        try:
            with tracing.child("queue", **{"fleetgate.deployment": dep.name}):
                ticket = await dep.queue.acquire(
                    principal.tenant,
                    cost,
                    priority=hints.priority,
                    timeout_s=hints.timeout_s,
                    continuing=continuing,
                    background=hints.background,
                )
        except BaseException:
            work.close()  # never awaited: close it so Python does not warn
            raise
        granted = time.perf_counter()
        metrics.child(metrics.QUEUE_TIME, dep.name, principal.tenant).observe(granted - queued_at)
        try:
            with tracing.child(
                "backend", **{"fleetgate.deployment": dep.name, "fleetgate.backend": dep.spec.backend}
            ):
                return await work, time.perf_counter() - granted
        finally:
            dep.queue.release(ticket, cost)

    async def _admit(self, principal: Principal, model: str, cost: int) -> Reservation:
        """Admit in a task of its own: a caller cancelled meanwhile (deadline, disconnect) cannot
        leave a reservation the store granted without anyone to settle it. A tenant with nothing
        to check is admitted at once, without the task: there is no round trip to guard."""
        try:
            with tracing.child("admit", **{"fleetgate.cost": cost}):
                granted = self.admission.admit_at_once(principal, model, cost)
                if granted is not None:
                    return granted
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
        self.settlement.hold(asyncio.ensure_future(self.admission.reconcile(task.result(), 0, failed=True)))

    # --- text generation -------------------------------------------------------------------

    async def estimate_prompt_tokens(self, plan: Plan, request: GenerateRequest) -> int:
        """Prompt tokens to reserve at admission, as the plan's first deployment counts them: exact
        where the backend tokenizes, else its estimate (settled by the upstream's usage at the end)."""
        backend = self.deployments[plan.primary].backend
        if Capability.GENERATE not in backend.capabilities:
            return estimate_prompt_tokens(request)  # refused by start_generation with a clear 400
        return int(await as_generative(backend).count_prompt_tokens(request))

    async def start_generation(
        self,
        principal: Principal,
        plan: Plan,
        request: GenerateRequest,
        prompt_tokens: int,
        hints: QueueHints = NO_HINTS,
        span: Any = None,
    ) -> tuple[GenerationStream, Served]:
        """Admit and start a generation; returns the stream once the first event is in hand.

        The caller must iterate the stream to its end or `aclose()` it: either settles the queue
        ticket and the admission reservation (see `GenerationStream`).

        The first event is awaited here so that a deployment that fails before producing anything
        can still be replaced by the next one in the plan, and so that errors before the first
        token reach the caller as a proper error instead of a broken stream.
        """
        candidates = self._candidates(plan, Capability.GENERATE)
        cost = prompt_tokens + request.sampling.max_tokens
        reservation = await self._admit(principal, plan.model, cost)

        async def attempt(dep: Deployment) -> tuple[GenerationStream, float, float]:
            with tracing.child("queue", **{"fleetgate.deployment": dep.name}):
                ticket = await dep.queue.acquire(
                    principal.tenant,
                    cost,
                    priority=hints.priority,
                    timeout_s=hints.timeout_s,
                    background=hints.background,
                )
            started = time.perf_counter()
            stream = as_generative(dep.backend).generate(request)
            try:
                with tracing.child("backend.first_token", **{"fleetgate.deployment": dep.name}):
                    first = await _first_event(stream, request.request_id)
            except BaseException:
                dep.queue.release(ticket, 0)
                raise
            # A stream's latency and service time are its time to first event: the rest of it runs
            # at the pace the client reads, which says nothing about the deployment's load.
            first_event_s = time.perf_counter() - started
            if span is not None:
                span.set_attribute("llm.time_to_first_token_s", first_event_s)
            job = StreamJob(principal, plan, dep, request, ticket, reservation, prompt_tokens, span)
            return GenerationStream(self.settlement, job, stream, first), first_event_s, first_event_s

        try:
            # a prompt cannot be checked against another route cheaply: a generation's 4xx is taken
            # as the caller's own and never counts against a canary
            events, dep = await self._attempt_each(plan, candidates, attempt, lambda dep, exc: True)
        except BaseException:
            await self.admission.reconcile(reservation, 0, failed=True)
            raise
        return events, Served(deployment=dep, plan=plan, headers=self.admission.headers(reservation))


def _choice_request(request: GenerateRequest, index: int) -> GenerateRequest:
    """Choice `index` of an `n` request: its own request id, and seed + index when seeded."""
    seed = request.sampling.seed
    return msgspec.structs.replace(
        request,
        request_id=f"{request.request_id}-{index}",
        sampling=msgspec.structs.replace(request.sampling, seed=None if seed is None else seed + index),
    )


def _graph_version(model: ModelRef) -> None:
    """A graph has no versions or labels: asking for one is asking for something that does not exist."""
    if model.version is not None or model.label is not None:
        raise ModelNotFound(f"graph {model.name!r} has no versions or labels; call it by its name")


async def _first_event(events: Any, request_id: str) -> TokenEvent:
    """A generation's first event; a stream that ends at once is an empty answer that stopped."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return TokenEvent(request_id=request_id, finish_reason="stop", usage=Usage())


def _hints(call: Call) -> QueueHints:
    """The call's fair-queue hints: a batch job's line waits in the background class; an
    interactive call asks with its headers."""
    if call.principal is not None and call.principal.background is not None:
        return BACKGROUND_HINTS
    return queue_hints(call.headers)


def _call_attributes(call: Call) -> dict[str, Any]:
    """A request span's attributes: never the key, the prompt or the payload."""
    return {
        "fleetgate.protocol": call.protocol,
        "fleetgate.model": call.model or None,
        "fleetgate.request_id": call.request_id,
    }


def _end_span(span: Any, error: BaseException | None = None) -> None:
    if span is None:
        return
    if error is not None:
        span.set_attribute("error.type", type(error).__name__)
    span.end()
