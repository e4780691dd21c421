"""The request pipeline, protocol-free: one entry per kind of work, each a sequence of named steps.

A protocol adapter (HTTP in gateway/http/, gRPC in gateway/grpc/, a batch line, a test double)
turns its wire request into a `Call` and asks `GatewayCore` for one thing: `serve_tensors`,
`serve_generation`, `serve_embeddings`, `model_view` or `visible_models`. The steps, in order:

    identify -> plan -> room -> load -> admit -> attempt -> settle -> record

- identify: authenticate the credential (`identify`, a `Principal`); a draining process refuses here
- plan: the router's `Plan` (primary, fallbacks, shadows) for the model, version or label
- room: refuse at once when the first deployment's queue has no room for the tenant (`check_room`)
- load: read and decode the payload through the adapter's loader, under the call's deadline
- admit: limits, quotas, leases for the cost (gateway/core/admit.py, a `Reservation`)
- attempt: a queue turn and the backend call on each candidate until one answers
  (gateway/core/queue/turn.py, gateway/core/attempts.py, an `Attempted`)
- settle: reconcile the reservation with what was used (a stream settles at its end)
- record: who served, on the call (access log, metrics) and the request span

The kinds of work live beside this file: tensors.py, generation.py, embeddings.py, graphs/runner.py.
Admin, console, reload and adapters change the live state only through `operations.py`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from backends.base import Capability, ModelMetadata, TensorRequest, TensorResponse
from backends.errors import InvalidInput, ModelNotFound
from backends.runtime.validation import validate_request
from fleetgate import tracing
from fleetgate.errors import GatewayError
from gateway.config import Config
from gateway.core.admit import Admitter
from gateway.core.attempts import Attempted, Attempts
from gateway.core.calls import Call, ModelRef
from gateway.core.deadline import Deadline
from gateway.core.drain_state import DrainState
from gateway.core.embeddings import EmbeddingsPath
from gateway.core.fleet.adapter_models import base_model_of, declared_adapters, served_models
from gateway.core.fleet.deployments import Deployment, FleetSignals
from gateway.core.fleet.outcomes import Outcomes
from gateway.core.fleet.readiness import deployment_states, fleet_ready
from gateway.core.fleet.shadowing import Shadows
from gateway.core.generation import GenerationPath
from gateway.core.graphs.runner import GraphRunner
from gateway.core.queue.hints import BACKGROUND_HINTS, NO_HINTS, QueueHints, queue_hints
from gateway.core.record import check_graph_version, end_span, record_server, span_attributes
from gateway.core.results import (
    D,
    EmbeddingsInput,
    EmbeddingsOutcome,
    GenerationInput,
    ModelView,
    P,
    Served,
    StartedGeneration,
    TensorOutcome,
)
from gateway.core.streams import StreamSettlement
from gateway.core.tensors import TensorPath
from policies.admission import Admission
from policies.errors import Unauthenticated
from policies.identity import Identity
from policies.keys import KeyService
from policies.principal import Principal
from router.health import CircuitBreakers
from router.load import ServiceTimes
from router.planner import Plan, Router
from router.spec import ModelConfig


class GatewayCore:
    """The live state of one gateway process and the request pipeline over it.

    Read-only to everyone else: admin, console, reload and adapter management change it through
    `gateway.core.operations.Operations`, which is the only code that assigns its fields.
    """

    def __init__(
        self,
        config: Config,
        deployments: dict[str, Deployment],
        router: Router,
        keys: KeyService,
        admission: Admission,
        breakers: CircuitBreakers | None = None,
        service_times: ServiceTimes | None = None,
        drain: DrainState | None = None,
    ) -> None:
        self.config = config
        self.deployments = deployments
        self.router = router
        self.keys = keys
        self.identity = Identity(keys, config.auth, list(config.tenants))  # API keys, and JWTs (auth.jwt)
        self.admission = admission
        self.breakers = breakers or CircuitBreakers()
        self.service_times = service_times or ServiceTimes()
        self.signals = FleetSignals(deployments, self.breakers, self.service_times)
        self.shadows = Shadows(deployments)
        models = lambda: self.config.models  # noqa: E731 - read at each call: a reload's models apply
        #: what a running stream needs at its end (and the settlements still running)
        self.settlement = StreamSettlement(admission, self.shadows, deployments, models)
        #: the process's drain after SIGTERM (gateway/serve/drain.py): not ready, then refusing new calls
        self.drain = drain or DrainState()
        #: LoRA adapters served as models: model name -> the deployment of its base
        self.adapter_models: dict[str, str] = declared_adapters(config)
        outcomes = Outcomes(self.breakers, router, self.service_times)
        self.attempts = Attempts(deployments, self.breakers, outcomes, self.is_healthy)
        self._admitter = admitter = Admitter(admission, self.settlement)
        self.tensors = TensorPath(deployments, admission, admitter, self.attempts, self.shadows, models)
        self.generation = GenerationPath(deployments, admission, admitter, self.attempts, self.settlement)
        self.embeddings = EmbeddingsPath(admission, admitter, self.attempts)
        #: the config's `graphs:`, served as models (gateway/core/graphs/runner.py)
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
        drain: DrainState | None = None,
    ) -> GatewayCore:
        """The core with its router, wired to the same breakers and service times (no cycle)."""
        signals = FleetSignals(deployments, breakers, service_times)
        models = served_models(config, declared_adapters(config))
        router = Router(models, is_healthy=signals.is_healthy, expected_wait=signals.expected_wait)
        return cls(config, deployments, router, keys, admission, breakers, service_times, drain)

    # --- entries for protocol adapters ---------------------------------------------------------

    async def identify(self, call: Call) -> Principal:
        """Step identify: authenticate the call's credential; the tenant is recorded on the call.

        Every call of every protocol starts here, so a draining process refuses new work here.
        """
        if self.drain.refusing:
            message = "this gateway instance is shutting down; retry (another instance will answer)"
            raise GatewayError(503, "shutting_down", message, headers={"Retry-After": "1"})
        if call.principal is not None:  # made by the gateway itself (a batch line), already known
            principal = call.principal
            if call.authenticated_ns is not None:  # the body hook checked the key before this span opened
                tracing.past_step("authenticate", *call.authenticated_ns)
        else:
            with tracing.step("authenticate"):
                principal = await self.identity.authenticate(call.api_key)
        if principal.tenant not in self.config.tenants:
            raise Unauthenticated("the API key belongs to a tenant that is no longer configured")
        call.tenant = principal.tenant
        return principal

    async def serve_tensors(
        self, call: Call, model: ModelRef, load: Callable[[ModelMetadata], Awaitable[D]]
    ) -> TensorOutcome[D]:
        """Serve one tensor call: identify, plan, room, load (given the first candidate's
        metadata), admit, attempt, settle, record. All of it under the call's deadline."""
        call.model = model.name
        with tracing.span(
            "fleetgate.request", tracing.extract_context(call.headers), call.span_start_ns, **span_attributes(call)
        ) as span:
            principal = await self.identify(call)
            if model.name in self.config.graphs:
                return await self._serve_graph(call, principal, model, load, span)
            plan = self.plan(principal, model.name, model.version, model.label, call.headers)
            self.check_room(principal, plan)
            async with self.deadline(call).scope():
                # decoded against the first deployment that will be tried (TF Serving's row form
                # needs its signature); one that is down is skipped as `infer` skips it
                first = self.attempts.candidates(plan, Capability.TENSOR)[0]
                decoded = await load(first.backend.metadata())
                response, served = await self.tensors.infer(principal, plan, decoded.request, _hints(call))
            record_server(call, served, span)
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
        graph, its steps run (gateway/core/graphs/runner.py), and usage recorded per step beside it."""
        self.check_visible(principal, model.name)
        check_graph_version(model)
        # the worst case of the graph as asked for: read before the first await (a reload may remove it)
        steps = [step.model for step in self.config.graphs[model.name].steps.values()]
        async with self.deadline(call).scope():
            meta = self.graphs.metadata(model.name)
            decoded = await load(meta)
            validate_request(decoded.request, meta)
            cost = decoded.request.batch_rows
            hints = _hints(call)  # a bad hint header is refused before it costs a rate-limit slot
            worst = self._admitter.prices.graph_worst(steps, cost)
            reservation = await self._admitter.admit(principal, model.name, cost, worst)
            try:
                result = await self.graphs.run(principal, model.name, decoded.request, hints, call.headers)
            except BaseException:
                await self.admission.reconcile(reservation, 0, failed=True)
                raise
            parts = {f"{model.name}/{step}": rows for step, rows in result.rows.items()}
            ran = [(result.models[step], dep, result.rows[step]) for step, dep in result.served_by.items()]
            spent = self._admitter.prices.charge_steps(principal.tenant, model.name, ran)
            await self.admission.reconcile(reservation, cost, parts=parts, cost_micros=spent)
        plan = Plan(model=model.name, primary="", fallbacks=(), shadows=())
        served = Served(None, plan, self.admission.headers(reservation), result.description(model.name))
        record_server(call, served, span)
        return TensorOutcome(decoded, result.response, served)

    async def serve_generation(
        self, call: Call, load: Callable[[], Awaitable[GenerationInput]]
    ) -> StartedGeneration:
        """Start one generation: identify, load (the model is named in the payload), plan, room,
        build the request, count the prompt, admit, attempt (queue turn + first event). The caller
        iterates the returned stream to its end or closes it; either settles (the settle step)."""
        # the request's span ends when its stream settles (GenerationStream), not here
        span = tracing.start_span(
            "fleetgate.request", tracing.extract_context(call.headers), call.span_start_ns, **span_attributes(call)
        )
        try:
            deadline = self.deadline(call)
            # one deadline scope from the payload's load to the first event: each scope arms a timer
            with tracing.current(span):
                async with deadline.scope():
                    principal, given, plan = await self._payload_call(call, load)
                    request = given.build()
                    request.tenant = principal.tenant
                    request.adapter = plan.model if plan.model in self.adapter_models else None
                    prompt_tokens = await self.generation.estimate_prompt_tokens(plan, request)
                    hints = _hints(call)
                    if given.n == 1:
                        stream, served = await self.generation.start(
                            principal, plan, request, prompt_tokens, hints, span
                        )
                        streams = [stream]
                    else:
                        streams, served = await self.generation.start_choices(
                            principal, plan, request, prompt_tokens, given.n, hints, span
                        )
        except BaseException as exc:
            end_span(span, exc)
            raise
        record_server(call, served, span)
        return StartedGeneration(streams[0], served, given.body, deadline, streams)

    async def serve_embeddings(
        self, call: Call, load: Callable[[], Awaitable[EmbeddingsInput]]
    ) -> EmbeddingsOutcome:
        """Serve one embeddings call: identify, load, plan, room, then gateway/core/embeddings.py
        (bound, admit, tokenize off the loop, attempt, settle), record."""
        with tracing.span(
            "fleetgate.request", tracing.extract_context(call.headers), call.span_start_ns, **span_attributes(call)
        ) as span:
            deadline = self.deadline(call)
            async with deadline.scope():
                principal, given, plan = await self._payload_call(call, load)
                outcome = await self.embeddings.embed(principal, plan, given, call.request_id, _hints(call))
            record_server(call, outcome.served, span)
            return outcome

    async def _payload_call(self, call: Call, load: Callable[[], Awaitable[P]]) -> tuple[Principal, P, Plan]:
        """The first steps of a call whose model is named in its payload: identify, load, plan, and
        room (before tokenizing or admission). The caller runs them under the call's deadline."""
        principal = await self.identify(call)
        given = await load()
        call.model = given.model.name
        plan = self.plan(principal, given.model.name, given.model.version, given.model.label, call.headers)
        self.check_room(principal, plan)
        return principal, given, plan

    async def model_view(self, call: Call, model: ModelRef) -> ModelView:
        """A model as the caller may see it (metadata, versions, readiness)."""
        call.model = model.name
        principal = await self.identify(call)
        if model.name in self.config.graphs:
            self.check_visible(principal, model.name)
            check_graph_version(model)
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

    # --- steps other entries reuse (graphs, batch lines, tests) --------------------------------

    async def infer(
        self, principal: Principal, plan: Plan, request: TensorRequest, hints: QueueHints = NO_HINTS
    ) -> tuple[TensorResponse, Served]:
        """Admit, attempt and settle a tensor request (gateway/core/tensors.py)."""
        return await self.tensors.infer(principal, plan, request, hints)

    async def run_tensors(
        self, principal: Principal, plan: Plan, request: TensorRequest, hints: QueueHints = NO_HINTS
    ) -> Attempted[TensorResponse]:
        """Attempt an admitted tensor request (a graph step: the graph was admitted once)."""
        return await self.tensors.run(principal, plan, request, hints)

    # --- identity and visibility ----------------------------------------------------------------

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
        """Whether probes should send traffic here (`server.readiness`)."""
        return fleet_ready(self.config.server.readiness, self.drain.draining, self.deployments)

    def deployment_status(self) -> dict[str, dict[str, object]]:
        return deployment_states(self.deployments)

    def is_healthy(self, deployment: str) -> bool:
        """Loaded, warmed up, and its circuit breaker lets requests through."""
        return self.signals.is_healthy(deployment)

    def expected_wait(self, deployment: str) -> float:
        """Seconds until a new request would be done on `deployment` (see router.load)."""
        return self.signals.expected_wait(deployment)

    # --- the plan and room steps ----------------------------------------------------------------

    def plan(
        self,
        principal: Principal,
        model: str,
        version: str | None,
        label: str | None,
        headers: dict[str, str] | Any,
    ) -> Plan:
        """Step plan: the router's choice for a model the caller may see."""
        self.check_visible(principal, model)
        if model in self.config.graphs:  # graphs are served by `serve_tensors` and `model_view` only
            raise InvalidInput(
                f"model {model!r} is a graph of tensor models; call it on the v2 or TF Serving endpoints"
            )
        with tracing.step("route"):
            return self.router.plan(model, version=version, label=label, principal=principal, headers=headers)

    def check_room(self, principal: Principal, plan: Plan) -> None:
        """Step room: refuse now (429/503) when the plan's first deployment has no queue room for
        this tenant. Called before the body is read: a flooding tenant whose queue is full costs the
        header parse and a cached key check, not the read, decode and admission of its body.
        """
        dep = self.deployments.get(plan.primary)
        # a batch job's line waits in the background class, which has no bound of its own (the job
        # paces itself); the tenant's full interactive queue says nothing about it
        if dep is not None and principal.background is None:
            dep.queue.check_room(principal.tenant)


def _hints(call: Call) -> QueueHints:
    """The call's fair-queue hints: a batch job's line waits in the background class; an
    interactive call asks with its headers."""
    if call.principal is not None and call.principal.background is not None:
        return BACKGROUND_HINTS
    return queue_hints(call.headers)
