"""The tensor steps: admit a request's rows, run it on the plan's deployments, settle what it used."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from backends.base import Capability, TensorRequest, TensorResponse, as_tensor
from backends.errors import InvalidInput
from backends.runtime.validation import validate_request
from gateway.core.admit import Admitter
from gateway.core.attempts import Attempted, Attempts
from gateway.core.fleet.deployments import Deployment
from gateway.core.fleet.shadowing import Shadows
from gateway.core.queue.hints import NO_HINTS, QueueHints
from gateway.core.queue.row_slices import CONTINUING_PRIORITY, join_row_slices, row_slices
from gateway.core.queue.turn import run_in_turn
from gateway.core.results import Served
from policies.admission import Admission
from policies.pricing import Usage
from policies.principal import Principal
from router.planner import Plan
from router.spec import ModelConfig


class TensorPath:
    """Serves admitted tensor work: whole requests, row slices, shadows, caller-fault checks."""

    def __init__(
        self,
        deployments: Mapping[str, Deployment],
        admission: Admission,
        admitter: Admitter,
        attempts: Attempts,
        shadows: Shadows,
        models: Callable[[], Mapping[str, ModelConfig]],
    ) -> None:
        self._deployments = deployments
        self._admission = admission
        self._admitter = admitter
        self._attempts = attempts
        self._shadows = shadows
        self._models = models

    async def infer(
        self, principal: Principal, plan: Plan, request: TensorRequest, hints: QueueHints = NO_HINTS
    ) -> tuple[TensorResponse, Served]:
        """Admit, queue and run a tensor request, falling back along the plan on retryable errors.

        `hints` (priority, queue deadline) apply in each deployment's fair queue it waits in.
        """
        candidates = self._attempts.candidates(plan, Capability.TENSOR)
        cost = request.batch_rows
        worst = self._admitter.prices.worst(plan.model, candidates, rows=cost)
        reservation = await self._admitter.admit(principal, plan.model, cost, worst)
        used, spent = 0, 0
        try:
            response, dep = await self.run(principal, plan, request, hints, candidates)
            used = cost
            spent = self._admitter.prices.charge(principal.tenant, plan.model, dep, Usage(rows=used))
        finally:
            # a request that got no answer costs no usage and no request quota (README: what a
            # failure costs); its rate-limit slot stays spent, so failures cannot flood for free
            await self._admission.reconcile(
                reservation, used, failed=used == 0, cost_micros=spent, deployment=dep.name if used else ""
            )
        return response, Served(deployment=dep, plan=plan, headers=self._admission.headers(reservation))

    async def run(
        self,
        principal: Principal,
        plan: Plan,
        request: TensorRequest,
        hints: QueueHints = NO_HINTS,
        candidates: list[Deployment] | None = None,
    ) -> Attempted[TensorResponse]:
        """Queue and run an admitted tensor request on the plan's deployments, falling back on
        retryable errors; returns the answer and the deployment that gave it. The caller admitted
        and settles it (`infer`; a graph admits once for all its steps)."""
        if candidates is None:
            candidates = self._attempts.candidates(plan, Capability.TENSOR)
        cost = request.batch_rows

        async def attempt(dep: Deployment) -> tuple[TensorResponse, float, float]:
            started = time.perf_counter()
            slices = row_slices(request, dep.queue.spec.split_rows, dep.backend.metadata())
            if slices is None:
                work = as_tensor(dep.backend).infer(request)
                response, service_s = await run_in_turn(dep, principal.tenant, cost, work, hints)
            else:
                response, service_s = await self._run_in_slices(principal, dep, slices, hints)
            return response, time.perf_counter() - started, service_s

        def caller_fault(dep: Deployment, exc: BaseException) -> bool:
            return isinstance(exc, InvalidInput) and self._refused_by_every_route(plan, dep, request)

        answered = await self._attempts.each(plan, candidates, attempt, caller_fault)
        self._shadows.mirror_tensor(plan, answered.deployment, request, answered.result)
        return answered

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
            answer, seconds = await run_in_turn(
                dep,
                principal.tenant,
                part.batch_rows,
                backend.infer(part),
                hints if index == 0 else continuing,
                continuing=index > 0,
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
        model = self._models().get(plan.model)
        others = {r.deployment for r in model.routes} - {refused_by.name} if model else set()
        mine = refused_by.backend.metadata().inputs
        for name in others:
            dep = self._deployments.get(name)
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
