"""The embeddings steps: bound the inputs, admit on an estimate, tokenize, attempt, settle by tokens.

The inputs' count and bytes are checked and the call admitted before any tokenizing: a refused or
oversized call costs no tokenizer time, and tokenizing a large input runs off the event loop. The
call is charged the tokens it really used (also its cost in the fair queue).
"""

from __future__ import annotations

import time

import numpy as np

from backends.base import Capability, EmbedRequest
from backends.embedding import as_embedding_adapter
from gateway.core.admit import Admitter
from gateway.core.attempts import Attempts, any_fault
from gateway.core.fleet.deployments import Deployment
from gateway.core.queue.hints import QueueHints
from gateway.core.queue.turn import run_in_turn
from gateway.core.results import EmbeddingsInput, EmbeddingsOutcome, Served
from policies.admission import Admission
from policies.pricing import Usage
from policies.principal import Principal
from router.planner import Plan


class EmbeddingsPath:
    """Serves embeddings on the plan's deployments, charged by the tokens of the inputs."""

    def __init__(self, admission: Admission, admitter: Admitter, attempts: Attempts) -> None:
        self._admission = admission
        self._admitter = admitter
        self._attempts = attempts

    async def embed(
        self, principal: Principal, plan: Plan, given: EmbeddingsInput, request_id: str, hints: QueueHints
    ) -> EmbeddingsOutcome:
        """Check, admit, tokenize and embed `given` on the plan's deployments (call it under the
        call's deadline)."""
        candidates = self._attempts.candidates(plan, Capability.EMBED)
        first = as_embedding_adapter(candidates[0].backend)
        text_bytes = first.check_embedding(given.inputs, given.dimensions)
        estimate = first.estimate_tokens(given.inputs)
        worst = self._admitter.prices.worst(plan.model, candidates, input_tokens=estimate)
        reservation = await self._admitter.admit(principal, plan.model, estimate, worst)
        dep: Deployment | None = None
        used = 0
        try:
            request = await first.tokenize_embedding(given.inputs, request_id, given.dimensions, text_bytes)

            async def attempt(dep: Deployment) -> tuple[tuple[EmbedRequest, np.ndarray], float, float]:
                started = time.perf_counter()
                backend = as_embedding_adapter(dep.backend)
                tokens = request
                if dep is not candidates[0]:  # another encoder: its own checks and tokenizer
                    size = backend.check_embedding(given.inputs, given.dimensions)
                    tokens = await backend.tokenize_embedding(given.inputs, request_id, given.dimensions, size)
                work = backend.embed(tokens)
                vectors, service_s = await run_in_turn(dep, principal.tenant, tokens.tokens, work, hints)
                return (tokens, vectors), time.perf_counter() - started, service_s

            (served_request, vectors), dep = await self._attempts.each(plan, candidates, attempt, any_fault)
            used = served_request.tokens
        finally:
            priced = Usage(input_tokens=used, requests=1 if used else 0)
            cost = self._admitter.prices.charge(principal.tenant, plan.model, dep, priced) if used else 0
            served_by = dep.name if dep is not None else ""
            await self._admission.reconcile(
                reservation, used, failed=used == 0, cost_micros=cost, deployment=served_by
            )
        served = Served(deployment=dep, plan=plan, headers=self._admission.headers(reservation))
        return EmbeddingsOutcome(vectors, used, served, given.body)
