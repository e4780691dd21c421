"""A started generation as the caller sees it: its events, and exactly-once accounting at the end.

`GatewayCore.start_generation` admits, queues and starts a generation, then hands its events over
as a `GenerationStream`; everything that must happen while and after they are delivered (charging
the fair queue per token, renewing the concurrency lease, settling queue and quotas once, mirroring
to a shadow) lives here.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from backends.base import BYTES_PER_TOKEN, GenerateRequest, TokenEvent, Usage, estimate_text_tokens
from gateway.core.fleet.deployments import Deployment
from gateway.core.fleet.shadowing import Shadows
from gateway.core.money.prices import Prices
from gateway.observe import metrics
from policies.admission import Admission, Reservation
from policies.fair_queue import Ticket
from policies.principal import Principal
from router.planner import Plan
from router.spec import ModelConfig

__all__ = [
    "BYTES_PER_TOKEN",
    "ChoiceShare",
    "GenerationStream",
    "StreamJob",
    "StreamSettlement",
    "estimate_text_tokens",
]


class StreamSettlement:
    """The narrow part of the gateway a running stream needs: renewing its concurrency lease,
    settling its reservation, mirroring a finished completion to shadows, and keeping the
    settlements that run as tasks alive until they end."""

    def __init__(
        self,
        admission: Admission,
        shadows: Shadows,
        deployments: Mapping[str, Deployment],
        models: Callable[[], Mapping[str, ModelConfig]],
    ) -> None:
        self.admission = admission
        self.shadows = shadows
        #: what a call costs (its reservation's worst case at admission, its real cost at its end),
        #: at the prices of the live deployments and models
        self.prices = Prices(deployments, models)
        #: settlements still running (held so that they are not garbage-collected)
        self.running: set[asyncio.Future[None]] = set()

    def hold(self, task: asyncio.Future[None]) -> None:
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    async def wait_all(self) -> None:
        """Until every settlement has finished (at shutdown, before the state store closes)."""
        while self.running:
            await asyncio.gather(*list(self.running), return_exceptions=True)


class ChoiceShare:
    """One admission shared by the `n` choices of a request (OpenAI `n` > 1): each choice's stream
    reports what it used when it settles, and the reservation is reconciled once, when all have: the
    prompt counted once, the completions summed; failed only if every choice failed."""

    def __init__(
        self,
        admission: Admission,
        prices: Prices,
        reservation: Reservation,
        parts: int,
        span: Any = None,
        queue: Any = None,
        ticket: Ticket | None = None,
    ) -> None:
        self.admission = admission
        self.prices = prices
        self.reservation = reservation
        #: the one fair-queue ticket of all the choices, released with their total service at the end
        self._queue = queue
        self._ticket = ticket
        self._left = parts
        self._parts = parts
        self._failed = 0
        #: usage of every attempt (a deployment that failed part-way still used tokens: billed)
        self._prompt = 0
        self._completion = 0
        self._cached: int | None = None  # prompt tokens every choice found cached (the least)
        #: usage on the current deployment (what its fair-queue ticket is released at)
        self._attempt_prompt = 0
        self._attempt_completion = 0
        self._span = span
        #: the deployment the choices ran on (what they are priced at)
        self._dep: Deployment | None = None

    def begin_attempt(self, queue: Any, ticket: Ticket) -> None:
        """Start (again) on one deployment: its fair-queue ticket, every choice still to come."""
        self._queue, self._ticket = queue, ticket
        self._left, self._failed = self._parts, 0
        self._attempt_prompt = self._attempt_completion = 0
        self._cached = None  # as cached: what the choices of the deployment that answers found

    def abandon_attempt(self) -> None:
        """Not every choice could start on this deployment (the started ones are closed already):
        release its ticket at what they used; the reservation waits for the next deployment."""
        if self._queue is not None and self._ticket is not None:
            self._queue.release(self._ticket, float(self._attempt_prompt + 2 * self._attempt_completion))
        self._queue = self._ticket = None

    def choice_ticket(self) -> Ticket:
        """A ticket for one choice's stream: already released, so the stream neither charges nor
        releases the queue (the shared ticket is settled here, once)."""
        t = self._ticket
        assert t is not None
        return Ticket(
            id=t.id, tenant=t.tenant, cost=0.0, priority=t.priority, enqueued_at=t.enqueued_at,
            dispatched_at=t.dispatched_at, dispatch_seq=t.dispatch_seq, released=True,
        )  # fmt: skip

    async def fail(self) -> None:
        """No deployment could start every choice: the request got no answer, so it costs no usage
        and no request quota (as a single request that never started); the queue ticket of the
        last attempt, if still held, is released at what its started choices used."""
        if self._left <= 0:
            return
        self.abandon_attempt()
        self._left = 0  # late settlements of closed choices change nothing now
        # (the request's span is ended by the caller, with the error)
        await self.admission.reconcile(self.reservation, 0, failed=True)

    async def settle(self, usage: Usage, failed: bool, dep: Deployment | None = None) -> None:
        if self._left <= 0:
            return
        self._dep = dep or self._dep
        self._left -= 1
        self._failed += failed
        self._prompt = max(self._prompt, usage.prompt_tokens)
        self._completion += usage.completion_tokens
        cached = usage.cached_prompt_tokens
        self._cached = cached if self._cached is None else min(self._cached, cached)
        self._attempt_prompt = max(self._attempt_prompt, usage.prompt_tokens)
        self._attempt_completion += usage.completion_tokens
        if self._left > 0:
            return
        if self._queue is not None and self._ticket is not None:
            self._queue.release(self._ticket, float(self._attempt_prompt + 2 * self._attempt_completion))
        failed = self._failed == self._parts
        usage = Usage(
            prompt_tokens=self._prompt, completion_tokens=self._completion, cached_prompt_tokens=self._cached or 0
        )
        cost = self.prices.charge_generation(self.reservation.tenant, self.reservation.model, self._dep, usage, failed)
        try:
            await self.admission.reconcile(
                self.reservation, usage.total_tokens, failed=failed, cost_micros=cost,
                deployment=self._dep.name if self._dep is not None else "",
            )  # fmt: skip
        finally:
            _end_generation_span(self._span, usage)


@dataclass
class StreamJob:
    """Who and what a started generation is accounted to."""

    principal: Principal
    plan: Plan
    dep: Deployment
    request: GenerateRequest
    ticket: Ticket
    reservation: Reservation
    #: prompt tokens reserved at admission (exact where the backend has a tokenizer)
    prompt_tokens: int
    #: the request's trace span, ended when the stream settles (None while tracing is off)
    span: Any = None
    #: with OpenAI `n` > 1: the admission this choice shares with the others (settled by it)
    share: ChoiceShare | None = None


class GenerationStream:
    """The events of a started generation; settles its queue ticket and reservation exactly once.

    Iterate it to its end, or `aclose()` it (a client that went away): closing aborts the backend's
    work and settles, even when the stream was never iterated.

    Accounting follows what was handed out. Output tokens are counted per event: its token ids
    where it carries them, otherwise an estimate of its text (`BYTES_PER_TOKEN`). The fair queue
    (VTC) is charged as service is delivered: the ticket is rebased from `prompt + max_tokens` to the
    prompt tokens at the first event, then +2 per output token. At the end the ticket is released
    at `prompt + 2 x output` (release charges only the difference to what was charged, so nothing
    is counted twice) and the reservation reconciled at `prompt + output`, taken from the backend's
    `usage` when it reported one, else from the prompt estimate and the tokens delivered.
    """

    def __init__(
        self,
        settlement: StreamSettlement,
        job: StreamJob,
        stream: AsyncIterator[TokenEvent],
        first: TokenEvent,
    ) -> None:
        self._settlement = settlement
        self.job = job
        self._stream = stream
        self._next: TokenEvent | None = first
        #: output tokens handed out so far (exact or estimated, see the class docstring)
        self.delivered = 0
        self._text_bytes = 0
        self._usage: Usage | None = None
        self._final: TokenEvent | None = None
        self._closed = False
        #: the backend's stream raised: the generation failed (not a client that went away)
        self._errored = False
        self._settling: asyncio.Future[None] | None = None
        #: settled by `aclose` itself, without a task (`_settle_at_once`)
        self._settled_at_once = False
        # the completion, kept only when a shadow will compare it
        self._texts: list[str] | None = [] if job.plan.shadows else None
        self._token_ids: list[int] = []
        queue, ticket = job.dep.queue, job.ticket
        if not ticket.released:
            queue.charge(ticket, job.prompt_tokens - ticket.charged)

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._closed:
            raise StopAsyncIteration
        try:
            event = self._next if self._next is not None else await anext(self._stream, None)
            self._next = None
            if event is not None:
                # renews the concurrency lease of a long stream; its cut-off is not applied, as
                # counts of remote streams are estimates
                await self._settlement.admission.check_stream(
                    self.job.reservation, self.job.prompt_tokens + self.delivered
                )
        except BaseException as exc:
            self._errored = isinstance(exc, Exception)  # not a cancellation (the client left)
            await self.aclose()
            raise
        if event is None:  # the backend ended without a finish event
            await self.aclose()
            raise StopAsyncIteration
        self._count(event)
        if event.finish_reason is not None:
            self._final = event
            await self.aclose()  # settle now: the caller may never ask for more
        return event

    async def aclose(self) -> None:
        """Stop the stream (aborting the backend's work unless it finished) and settle. Idempotent.

        Where nothing in the settle waits (`_can_settle_at_once`: the usual finished stream under
        the lease strategy) it runs here, with no await to be cancelled in. Else it runs as its own
        task, awaited through a shield: a caller cancelled by a client disconnect (anyio cancels
        every await of a cancelled scope) cannot cut it short.
        """
        self._closed = True
        if self._settled_at_once:
            return
        if self._settling is None:
            if self._can_settle_at_once():
                # marked first: should the settle raise, a second `aclose` must not count it again
                self._settled_at_once = True
                self._settle_at_once()
                return
            task = asyncio.ensure_future(self._settle())
            self._settlement.hold(task)
            self._settling = task
        await asyncio.shield(self._settling)

    def _count(self, event: TokenEvent) -> None:
        if event.usage is not None:
            self._usage = event.usage
        if event.token_ids:
            new = len(event.token_ids)
        else:
            before = -(-self._text_bytes // BYTES_PER_TOKEN)
            self._text_bytes += len(event.text.encode()) + _tool_call_bytes(event)
            new = -(-self._text_bytes // BYTES_PER_TOKEN) - before
        self.delivered += new
        ticket = self.job.ticket
        if new and not ticket.released:
            self.job.dep.queue.charge(ticket, 2.0 * new)
        if self._texts is not None:
            self._texts.append(event.text)
            self._token_ids.extend(event.token_ids)

    def used(self) -> Usage:
        """Tokens to settle: the backend's usage when it reported any, else prompt + delivered."""
        if self._usage is not None and self._usage.total_tokens > 0:
            return self._usage
        return Usage(prompt_tokens=self.job.prompt_tokens, completion_tokens=self.delivered)

    def _can_settle_at_once(self) -> bool:
        """Whether nothing in the settle waits: a stream that finished (no abort to send) of a single
        choice whose reservation the admission settles in memory (the lease strategy's batch). Else
        `_settle` runs in a task of its own."""
        job, admission = self.job, self._settlement.admission
        return self._final is not None and job.share is None and admission.settles_at_once(job.reservation)

    def _settle_at_once(self) -> None:
        """The settle without its task (`_can_settle_at_once`)."""
        job = self.job
        usage, failed = self._release_and_count()
        try:
            cost = self._cost(usage, failed)
            settled = self._settlement.admission.reconcile_at_once(
                job.reservation, usage.total_tokens, failed=failed, cost_micros=cost, deployment=job.dep.name
            )
            assert settled, "settles_at_once said the reservation settles in memory"
        finally:
            _end_generation_span(self.job.span, usage)

    async def _settle(self) -> None:
        job = self.job
        try:
            if self._final is None:
                await job.dep.backend.abort(job.request.request_id)
                await _aclose(self._stream)
        finally:
            usage, failed = self._release_and_count()
            if job.share is not None:
                await job.share.settle(usage, failed, job.dep)
            else:
                await self._reconcile(usage, failed)

    def _release_and_count(self) -> tuple[Usage, bool]:
        """The settle's first part, which never waits: the queue turn released, the tokens counted,
        a shadow's comparison sent. Returns the usage and whether the generation failed."""
        job = self.job
        usage = self.used()
        job.dep.queue.release(job.ticket, float(usage.prompt_tokens + 2 * usage.completion_tokens))
        tenant, model = job.principal.tenant, job.plan.model
        metrics.child(metrics.TOKENS, tenant, model, "prompt").inc(usage.prompt_tokens)
        metrics.child(metrics.TOKENS, tenant, model, "completion").inc(usage.completion_tokens)
        completed = self._final is not None and self._final.finish_reason in ("stop", "length")
        if completed and self._texts is not None:
            text, shadows = "".join(self._texts), self._settlement.shadows
            shadows.mirror_text(job.plan, job.dep, job.request, text, self._token_ids)
        # failed before anything was delivered: no answer, so no request is counted (its prompt's
        # tokens were computed and stay charged)
        return usage, self._errored and self.delivered == 0

    def _cost(self, usage: Usage, failed: bool) -> int:
        job = self.job
        return self._settlement.prices.charge_generation(job.principal.tenant, job.plan.model, job.dep, usage, failed)

    async def _reconcile(self, usage: Usage, failed: bool) -> None:
        job = self.job
        try:
            await self._settlement.admission.reconcile(
                job.reservation, usage.total_tokens, failed=failed, cost_micros=self._cost(usage, failed),
                deployment=job.dep.name,
            )  # fmt: skip
        finally:
            _end_generation_span(self.job.span, usage)


def _end_generation_span(span: Any, usage: Usage) -> None:
    """End a generation's request span (None: not traced) with the tokens it used."""
    if span is not None:
        span.set_attribute("llm.prompt_tokens", usage.prompt_tokens)
        span.set_attribute("llm.completion_tokens", usage.completion_tokens)
        span.end()


async def _aclose(stream: AsyncIterator[TokenEvent]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        try:
            await close()
        except Exception:  # noqa: BLE001 - best effort
            pass


def _tool_call_bytes(event: TokenEvent) -> int:
    """The generated text inside an upstream's tool calls (names and arguments): output too, counted
    by the same bytes-per-token estimate where the upstream reports no usage."""
    total = 0
    for call in event.tool_calls or ():
        function = call.get("function") or {}
        total += len(str(function.get("name") or "").encode()) + len(str(function.get("arguments") or "").encode())
    return total
