"""The generation steps: count the prompt, admit, take a queue turn, start the stream(s).

A generation is handed back once its first event is in hand: a deployment that fails before
producing anything can still be replaced by the next one of the plan, and an error before the first
token reaches the caller as a proper error instead of a broken stream.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec

from backends.base import (
    Capability,
    GenerateRequest,
    TokenEvent,
    Usage,
    as_generative,
    estimate_prompt_tokens,
)
from fleetgate import tracing
from gateway.core.admit import Admitter
from gateway.core.attempts import Attempts, any_fault
from gateway.core.fleet.deployments import Deployment
from gateway.core.queue.hints import NO_HINTS, QueueHints
from gateway.core.queue.turn import take_turn
from gateway.core.results import Served
from gateway.core.streams import ChoiceShare, GenerationStream, StreamJob, StreamSettlement
from policies.admission import Admission
from policies.principal import Principal
from router.planner import Plan


class GenerationPath:
    """Starts generations on the plan's deployments: one choice, or `n` choices of one prompt."""

    def __init__(
        self,
        deployments: Mapping[str, Deployment],
        admission: Admission,
        admitter: Admitter,
        attempts: Attempts,
        settlement: StreamSettlement,
    ) -> None:
        self._deployments = deployments
        self._admission = admission
        self._admitter = admitter
        self._attempts = attempts
        self._settlement = settlement

    async def estimate_prompt_tokens(self, plan: Plan, request: GenerateRequest) -> int:
        """Prompt tokens to reserve at admission, as the plan's first deployment counts them: exact
        where the backend tokenizes, else its estimate (settled by the upstream's usage at the end)."""
        backend = self._deployments[plan.primary].backend
        if Capability.GENERATE not in backend.capabilities:
            return estimate_prompt_tokens(request)  # refused by `start` with a clear 400
        return int(await as_generative(backend).count_prompt_tokens(request))

    async def start(
        self,
        principal: Principal,
        plan: Plan,
        request: GenerateRequest,
        prompt_tokens: int,
        hints: QueueHints = NO_HINTS,
        span: Any = None,
    ) -> tuple[GenerationStream, Served]:
        """Admit and start one generation; returns the stream once the first event is in hand.

        The caller must iterate the stream to its end or `aclose()` it: either settles the queue
        ticket and the admission reservation (see `GenerationStream`).
        """
        candidates = self._attempts.candidates(plan, Capability.GENERATE)
        cost = prompt_tokens + request.sampling.max_tokens
        worst = self._admitter.prices.worst(
            plan.model, candidates, input_tokens=prompt_tokens, max_output_tokens=request.sampling.max_tokens
        )
        reservation = await self._admitter.admit(principal, plan.model, cost, worst)

        async def attempt(dep: Deployment) -> tuple[GenerationStream, float, float]:
            ticket = await take_turn(dep, principal.tenant, cost, hints)
            started = time.perf_counter()
            events = as_generative(dep.backend).generate(request)
            try:
                with tracing.child("backend.first_token", **{"fleetgate.deployment": dep.name}):
                    first = await first_event(events, request.request_id)
            except BaseException:
                dep.queue.release(ticket, 0)
                raise
            # A stream's latency and service time are its time to first event: the rest of it runs
            # at the pace the client reads, which says nothing about the deployment's load.
            first_event_s = time.perf_counter() - started
            if span is not None:
                span.set_attribute("llm.time_to_first_token_s", first_event_s)
            job = StreamJob(principal, plan, dep, request, ticket, reservation, prompt_tokens, span)
            return GenerationStream(self._settlement, job, events, first), first_event_s, first_event_s

        try:
            stream, dep = await self._attempts.each(plan, candidates, attempt, any_fault)
        except BaseException:
            await self._admission.reconcile(reservation, 0, failed=True)
            raise
        return stream, Served(deployment=dep, plan=plan, headers=self._admission.headers(reservation))

    async def start_choices(
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
        candidates = self._attempts.candidates(plan, Capability.GENERATE)
        cost = n * (prompt_tokens + request.sampling.max_tokens)
        # the prompt is counted once for all the choices (see ChoiceShare), their outputs summed
        worst = self._admitter.prices.worst(
            plan.model, candidates, input_tokens=prompt_tokens, max_output_tokens=n * request.sampling.max_tokens
        )
        reservation = await self._admitter.admit(principal, plan.model, cost, worst)
        share = ChoiceShare(self._admission, self._admitter.prices, reservation, n, span)

        async def attempt(dep: Deployment) -> tuple[list[GenerationStream], float, float]:
            ticket = await take_turn(dep, principal.tenant, cost, hints)
            share.begin_attempt(dep.queue, ticket)
            started = time.perf_counter()
            streams: list[GenerationStream] = []
            try:
                for i in range(n):
                    choice = choice_request(request, i)
                    events = as_generative(dep.backend).generate(choice)
                    first = await first_event(events, choice.request_id)
                    job = StreamJob(
                        principal, plan, dep, choice, share.choice_ticket(), reservation, prompt_tokens,
                        None, share,
                    )  # fmt: skip
                    streams.append(GenerationStream(self._settlement, job, events, first))
            except BaseException:
                for stream in streams:
                    await stream.aclose()
                share.abandon_attempt()
                raise
            first_event_s = time.perf_counter() - started
            return streams, first_event_s, first_event_s

        try:
            streams, dep = await self._attempts.each(plan, candidates, attempt, any_fault)
        except BaseException:
            await share.fail()
            raise
        return streams, Served(deployment=dep, plan=plan, headers=self._admission.headers(reservation))


def choice_request(request: GenerateRequest, index: int) -> GenerateRequest:
    """Choice `index` of an `n` request: its own request id, and seed + index when seeded."""
    seed = request.sampling.seed
    return msgspec.structs.replace(
        request,
        request_id=f"{request.request_id}-{index}",
        sampling=msgspec.structs.replace(request.sampling, seed=None if seed is None else seed + index),
    )


async def first_event(events: Any, request_id: str) -> TokenEvent:
    """A generation's first event; a stream that ends at once is an empty answer that stopped."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return TokenEvent(request_id=request_id, finish_reason="stop", usage=Usage())
