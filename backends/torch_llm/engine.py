"""The synchronous engine: add requests, run `step()` repeatedly, get per-request outputs.

One step = schedule -> forward pass -> sample -> detokenise -> finish checks -> free blocks. It is not
thread-safe: `async_engine` calls it from one dedicated thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog
import torch

from backends.base import SamplingParams
from backends.torch_llm import metrics as m
from backends.torch_llm.block_manager import BlockManager
from backends.torch_llm.detokenizer import Decoder, IncrementalDetokenizer
from backends.torch_llm.kv_waste import KVWasteStats
from backends.torch_llm.requests import check_prompt_ids, check_seed, check_token_biases
from backends.torch_llm.runner import ModelRunner
from backends.torch_llm.sampler import SamplingState, prefetch_grammar_masks, sample, top_logprobs
from backends.torch_llm.scheduler import Scheduler, WaitingQueue
from backends.torch_llm.sequence import Sequence, SequenceStatus
from backends.torch_llm.structured.grammar import CompiledGrammar

log = structlog.get_logger(__name__)

#: one sampled row: (token id, its logprob or None, the alternatives or None)
Picked = tuple[int, float | None, list[tuple[int, float]] | None]


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float] | None = None
    #: with `top_logprobs`: per token, the most likely (token id, logprob) pairs at its position
    top_logprobs: list[list[tuple[int, float]]] | None = None
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    #: of `prompt_tokens`, those the prefix cache served (at the request's first admission)
    cached_prompt_tokens: int = 0
    #: with finish_reason "error": what failed, in words safe to show the caller (no internals)
    error: str | None = None


@dataclass
class _Request:
    sampling: SamplingState
    detok: IncrementalDetokenizer | None
    stop_ids: frozenset[int]
    first_token_at: float | None = None
    #: when a step first computed this request (its queue time ends, its prefill begins)
    first_scheduled_at: float | None = None
    last_token_at: float | None = None


@dataclass
class EngineConfig:
    max_model_len: int
    eos_token_ids: frozenset[int]
    seed: int = 0
    deployment: str = "llm"
    #: token ids a prompt may hold are in [0, vocab_size); None skips the range check
    vocab_size: int | None = None
    labels: dict[str, str] = field(default_factory=dict)


class LLMEngine:
    """Continuous-batching engine over one model.

    Args:
        runner: model + KV cache.
        scheduler: batch policy over a block manager sized like `runner`.
        tokenizer: for detokenisation (None: outputs carry token ids only).
        config: limits and ids.
        clock: monotonic clock in seconds (injected so tests can move it).
    """

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        tokenizer: Decoder | None,
        config: EngineConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.config = config
        self.clock = clock
        self._seqs: dict[str, Sequence] = {}
        self._next_id = 0
        self.kv_waste = KVWasteStats()
        self.num_steps = 0
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # ... and found there
        self._label = config.deployment

    @classmethod
    def create(
        cls,
        runner: ModelRunner,
        tokenizer: Decoder | None,
        config: EngineConfig,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_tokens_with_decodes: int | None = None,
        enable_prefix_caching: bool = True,
        waiting: WaitingQueue | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> LLMEngine:
        lora = runner.lora
        bm = BlockManager(runner.num_blocks, runner.block_size, enable_prefix_caching=enable_prefix_caching)
        sched = Scheduler(
            bm,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            waiting=waiting,
            max_prefill_tokens_with_decodes=max_prefill_tokens_with_decodes,
            max_adapters=None if lora is None else lora.max_loras,
        )
        return cls(runner, sched, tokenizer, config, clock=clock)

    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_scope: str = "",
        adapter: str | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> None:
        """Queue a request (the caller checks the prompt's length against max_model_len).

        `grammar` is `params.structured` compiled (`GrammarCompiler.get`, off this thread): the
        request gets a matcher of its own, so `n` choices of one prompt each keep their own state.

        Everything a step will rely on is checked here, so that a malformed request is refused on
        its own instead of failing inside a step that other requests share.

        Raises:
            ValueError: a duplicate id, a token id that is not an int in the vocabulary, a seed
                outside the 64-bit range, or an adapter that is not loaded.
        """
        if request_id in self._seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        lora = self.runner.lora
        if adapter is not None and (lora is None or not lora.has(adapter)):
            raise ValueError(f"adapter {adapter!r} is not loaded on this engine")
        check_prompt_ids(prompt_token_ids, self.config.vocab_size)
        check_seed(params.seed)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.config.eos_token_ids
        )
        check_token_biases(params.logit_bias, self.config.vocab_size)
        state = _Request(
            sampling=SamplingState.create(
                params,
                self.runner.device,
                fallback_seed=self.config.seed + self._next_id,
                prompt_ids=prompt_token_ids,
                stop_ids=stop_ids,
                grammar=grammar,
                grammar_stop_ids=frozenset() if params.ignore_eos else self.config.eos_token_ids,
            ),
            detok=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)
            if self.tokenizer
            else None,
            stop_ids=stop_ids,
        )
        if adapter is not None and lora is not None:
            cache_scope = f"{cache_scope}\x1f{lora.cache_scope(adapter)}"
        seq = Sequence(
            self._next_id,
            request_id,
            prompt_token_ids,
            max_tokens=params.max_tokens,
            cache_scope=cache_scope,
            arrival_time=self.clock(),
            data=state,
            adapter=adapter,
        )
        if adapter is not None and lora is not None:
            lora.acquire(adapter)  # released by `_finish`, however the sequence ends
        self._next_id += 1
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        m.PROMPT_TOKENS.labels(self._label).inc(len(prompt_token_ids))

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks now; False when it is unknown or already finished."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self._finish(seq, "abort")
        m.REQUEST_SUCCESS.labels(self._label, "abort").inc()
        self._update_gauges()
        return True

    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns an output for every request that got a token or finished.

        A failure is confined to the requests it concerns: one in a request's own sampling or
        detokenisation ends that request with finish_reason "error"; one in the shared forward pass
        (which cannot be pinned on a request) ends only the requests scheduled in this step, and the
        engine goes on with the others.
        """
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        started = self.clock()
        for seq, _ in out.scheduled:
            if seq.data.first_scheduled_at is None:
                seq.data.first_scheduled_at = started
        prefetch_grammar_masks(out.scheduled)  # host work of the masks beside the forward pass
        try:
            logits, sampled = self.runner.execute(out.scheduled)
            scheduled, failed = out.scheduled, []
        except Exception:  # noqa: BLE001 - find the request(s) at fault, the engine goes on
            log.exception("llm_forward_failed", deployment=self._label, batch=len(out.scheduled))
            logits, sampled, scheduled, failed = self._execute_one_by_one(out.scheduled)
        for seq, n in scheduled:
            seq.num_computed_tokens += n
            self.block_manager.cache_full_blocks(seq)
        self._record_step(out.num_batched_tokens, len(out.preempted), out.prefix_queries, out.prefix_hits)
        if not sampled:
            self._update_gauges()
            return failed
        picked = self._sample(logits, sampled)
        now = self.clock()
        results = failed
        for seq, choice in zip(sampled, picked, strict=True):
            if isinstance(choice, Exception):
                results.append(self._fail(seq, choice))
                continue
            try:
                results.append(self._append(seq, choice[0], choice[1], now, choice[2]))
            except Exception as exc:  # noqa: BLE001 - this request's own failure (detokeniser, stop)
                log.exception("llm_request_failed", deployment=self._label, request_id=seq.request_id)
                results.append(self._fail(seq, exc))
        self._update_gauges()
        return results

    def _execute_one_by_one(
        self, scheduled: list[tuple[Sequence, int]]
    ) -> tuple[torch.Tensor, list[Sequence], list[tuple[Sequence, int]], list[RequestOutput]]:
        """Re-run a failed batch one request at a time: only the requests that fail alone fail.

        Re-running is safe: a request's KV slots and positions do not change until the step is
        accounted, so a retry writes the same cache entries again.

        Returns:
            (logits of the rows that ran, their sequences, what ran, outputs of the failed requests).
        """
        rows: list[torch.Tensor] = []
        sampled: list[Sequence] = []
        ran: list[tuple[Sequence, int]] = []
        failed: list[RequestOutput] = []
        for seq, n in scheduled:
            try:
                logits, seqs = self.runner.execute([(seq, n)])
            except Exception as exc:  # noqa: BLE001 - this request's own failure
                failed.append(self._fail(seq, exc))
                continue
            ran.append((seq, n))
            rows.append(logits)
            sampled.extend(seqs)
        logits = torch.cat(rows) if rows else torch.empty(0)
        return logits, sampled, ran, failed

    def _sample(self, logits: torch.Tensor, sampled: list[Sequence]) -> list[Picked | Exception]:
        """(token, logprob, alternatives) per row; when the batched call fails, row by row so only
        bad rows fail."""
        states = [seq.data.sampling for seq in sampled]
        try:
            tokens, logprobs = sample(logits, states)
            tops = top_logprobs(logits, states)
            return [
                (t, None if logprobs is None else logprobs[i], None if tops is None else tops[i])
                for i, t in enumerate(tokens)
            ]
        except Exception:  # noqa: BLE001 - find the row(s) at fault
            picked: list[Picked | Exception] = []
            for row, state in enumerate(states):
                try:
                    tokens, logprobs = sample(logits[row : row + 1], [state])
                    tops = top_logprobs(logits[row : row + 1], [state])
                    logprob = None if logprobs is None else logprobs[0]
                    picked.append((tokens[0], logprob, None if tops is None else tops[0]))
                except Exception as exc:  # noqa: BLE001
                    log.exception("llm_sampling_failed", request_id=sampled[row].request_id)
                    picked.append(exc)
            return picked

    def _fail(self, seq: Sequence, exc: BaseException) -> RequestOutput:
        """End `seq` with finish_reason "error" (its blocks are freed) and say so to its stream."""
        if seq.status is not SequenceStatus.FINISHED:
            self._finish(seq, "error")
        self._seqs.pop(seq.request_id, None)
        m.REQUEST_SUCCESS.labels(self._label, "error").inc()
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=[],
            text="",
            finish_reason="error",
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_prompt_tokens=seq.cached_prompt_tokens or 0,
            error=f"{type(exc).__name__} in the engine step",
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` in the scheduler (freeing its blocks) and let go of its adapter."""
        self.scheduler.finish(seq, reason)
        if seq.adapter is not None and self.runner.lora is not None:
            self.runner.lora.release(seq.adapter)

    def _update_gauges(self) -> None:
        sched, label = self.scheduler, self._label
        m.NUM_RUNNING.labels(label).set(len(sched.running))
        m.NUM_WAITING.labels(label).set(len(sched.waiting))
        m.KV_USAGE.labels(label).set(self.block_manager.usage)

    def _append(
        self,
        seq: Sequence,
        token: int,
        logprob: float | None,
        now: float,
        top: list[tuple[int, float]] | None = None,
    ) -> RequestOutput:
        req: _Request = seq.data
        seq.append_token(token)
        req.sampling.observe(token)
        m.GENERATION_TOKENS.labels(self._label).inc()
        if req.first_token_at is None:
            req.first_token_at = now
            m.TTFT.labels(self._label).observe(now - seq.arrival_time)
        else:
            m.ITL.labels(self._label).observe(now - (req.last_token_at or now))
        req.last_token_at = now
        reason = None
        stopped_by_text = req.detok.add(token) if req.detok else False
        grammar = req.sampling.grammar
        if token in req.stop_ids or stopped_by_text or (grammar is not None and grammar.terminated):
            reason = "stop"
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            reason = "length"
        if reason is not None:
            self._finish(seq, reason)
            self._seqs.pop(seq.request_id, None)
            m.E2E.labels(self._label).observe(now - seq.arrival_time)
            m.observe_phases(self._label, seq.arrival_time, req.first_scheduled_at, req.first_token_at, now)
            m.REQUEST_SUCCESS.labels(self._label, reason).inc()
        return RequestOutput(
            request_id=seq.request_id,
            token_ids=[token],
            text=req.detok.take(final=reason is not None) if req.detok else "",
            logprobs=None if logprob is None or not req.sampling.params.logprobs else [logprob],
            top_logprobs=None if top is None or not req.sampling.params.logprobs else [top],
            finish_reason=reason,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=seq.num_output_tokens,
            cached_prompt_tokens=seq.cached_prompt_tokens or 0,
        )

    def _record_step(self, num_tokens: int, num_preempted: int, queries: int, hits: int) -> None:
        self.num_steps += 1
        label = self._label
        self.kv_waste.record(self.scheduler.running, self.runner.block_size, self.config.max_model_len)
        m.ITERATION_TOKENS.labels(label).observe(num_tokens)
        m.KV_WASTE.labels(label).set(self.kv_waste.last)
        if num_preempted:
            m.PREEMPTIONS.labels(label).inc(num_preempted)
        self.num_prefix_queries += queries
        self.num_prefix_hits += hits
        if queries:
            m.PREFIX_QUERIES.labels(label).inc(queries)
            m.PREFIX_HITS.labels(label).inc(hits)
