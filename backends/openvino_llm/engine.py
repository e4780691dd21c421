"""The thread that drives OpenVINO GenAI's ContinuousBatchingPipeline.

The pipeline is stepped by one thread of its own (never the event loop): it takes the requests the
gateway's fair queue has admitted (`add`), runs `step()` while any is unfinished, reads each
request's new tokens from its GenerationHandle, turns them into text (the own engine's incremental
detokenizer, with its stop-string holdback) and hands them to the request's asyncio queue. A request
whose client went away is cancelled (`GenerationHandle.cancel`), which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from backends.torch_llm import metrics as m
from backends.torch_llm.detokenizer import IncrementalDetokenizer

log = structlog.get_logger(__name__)


@dataclass
class StepOutput:
    """What one pipeline step gave one request."""

    #: new text (stop strings cut, a possible stop-string prefix held back)
    text: str
    #: new token ids
    token_ids: list[int]
    #: their log-probabilities (with `logprobs` asked for)
    logprobs: list[float] | None = None
    #: stop | length at the end, error | abort when it failed; None while it runs
    finish_reason: str | None = None
    #: why it failed (finish_reason error)
    error: str | None = None


@dataclass
class _Live:
    """One request in the pipeline (owned by the engine thread)."""

    request_id: str
    handle: Any  # openvino_genai GenerationHandle
    out: asyncio.Queue[StepOutput]
    loop: asyncio.AbstractEventLoop
    detok: IncrementalDetokenizer
    max_tokens: int
    logprobs: bool
    arrival: float
    first: float | None = None
    last: float | None = None
    completion: int = 0
    finish: str | None = None
    #: tokens held back by the detokenizer are only counted once emitted
    pending: list[int] = field(default_factory=list)


@dataclass
class _Add:
    request_id: str
    ids: list[int]
    config: Any
    stop: list[str]
    logprobs: bool
    max_tokens: int
    out: asyncio.Queue[StepOutput]
    loop: asyncio.AbstractEventLoop
    arrival: float


class PipelineEngine:
    """Owns a ContinuousBatchingPipeline and the thread that steps it.

    Args:
        pipeline: the loaded `openvino_genai.ContinuousBatchingPipeline`.
        tokenizer: the model's TextTokenizer (decoding, stop strings).
        name: deployment name (metrics label, thread name).
        max_num_seqs: the pipeline's running-batch size (the capacity the fair queue sees).
        clock: seconds, monotonic (tests move it).
    """

    def __init__(
        self,
        pipeline: Any,
        tokenizer: Any,
        *,
        name: str,
        max_num_seqs: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._pipe = pipeline
        self._tok = tokenizer
        self.name = name
        self._max_num_seqs = max_num_seqs
        self._clock = clock
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        #: requests added and not yet finished (read on the event loop for the capacity gate)
        self._active = 0
        self._lock = threading.Lock()
        #: outputs of the current pass, by the event loop that waits for them
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[StepOutput], StepOutput]]] = {}

    @property
    def capacity(self) -> tuple[int, int]:
        """(free sequence slots, free KV blocks): the pipeline manages its blocks itself, so only
        the slots gate the fair queue."""
        with self._lock:
            return max(0, self._max_num_seqs - self._active), 1 << 30

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"openvino-llm-{self.name}", daemon=True)
        self._thread.start()

    async def close(self) -> None:
        """Stop the thread; requests still running end with `abort`."""
        self._commands.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)

    def add(
        self, request_id: str, ids: list[int], config: Any, stop: list[str], *, logprobs: bool, max_tokens: int
    ) -> asyncio.Queue[StepOutput]:
        """Queue a request for the pipeline (called on the event loop); its outputs arrive on the
        returned queue."""
        out: asyncio.Queue[StepOutput] = asyncio.Queue()
        with self._lock:
            self._active += 1
        loop = asyncio.get_running_loop()
        self._commands.put(_Add(request_id, ids, config, stop, logprobs, max_tokens, out, loop, self._clock()))
        return out

    def abort_nowait(self, request_id: str) -> None:
        """Cancel a request (its consumer went away): the pipeline frees its sequence."""
        self._commands.put(request_id)

    # --- the engine thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._flush()
            if not self._take_commands(block=not self._live):
                break
            if not self._live:
                continue
            try:
                self._pipe.step()
            except Exception as exc:  # a failed step fails its requests, never the thread
                log.error("openvino_llm_step_failed", deployment=self.name, error=str(exc))
                for live in list(self._live.values()):
                    live.handle.cancel()
                    self._end(live, StepOutput("", [], finish_reason="error", error=str(exc)))
                continue
            now = self._clock()
            for live in list(self._live.values()):
                self._collect(live, now)
            self._observe()
        for live in list(self._live.values()):
            live.handle.cancel()
            self._end(live, StepOutput("", [], finish_reason="abort"))
        self._flush()

    def _take_commands(self, *, block: bool) -> bool:
        """Apply waiting adds and aborts; False once closed."""
        command = self._commands.get() if block else self._next_command()
        while command is not _EMPTY:
            if command is None:
                return False
            if isinstance(command, _Add):
                self._start(command)
            else:
                live = self._live.get(command)
                if live is not None:
                    live.handle.cancel()
                    self._forget(live)
            command = self._next_command()
        return True

    def _next_command(self) -> Any:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return _EMPTY

    def _start(self, add: _Add) -> None:
        import numpy as np
        import openvino as ov

        live = _Live(
            request_id=add.request_id,
            handle=None,
            out=add.out,
            loop=add.loop,
            detok=IncrementalDetokenizer(self._tok, add.ids, add.stop),
            max_tokens=add.max_tokens,
            logprobs=add.logprobs,
            arrival=add.arrival,
        )
        try:
            tensor = ov.Tensor(np.asarray([add.ids], dtype=np.int64))
            live.handle = self._pipe.add_request(next(self._ids), tensor, add.config)
        except Exception as exc:  # a config the pipeline refuses ends this request only
            self._send(live, StepOutput("", [], finish_reason="error", error=str(exc)))
            with self._lock:
                self._active -= 1
            return
        self._live[add.request_id] = live
        m.PROMPT_TOKENS.labels(self.name).inc(len(add.ids))
        m.QUEUE_TIME.labels(self.name).observe(max(0.0, self._clock() - add.arrival))

    def _collect(self, live: _Live, now: float) -> None:
        """Read what the step gave `live` and hand it to its consumer."""
        import openvino_genai as ov_genai

        status = live.handle.get_status()
        ids: list[int] = []
        logprobs: list[float] = []
        reason = None
        if live.handle.can_read():
            for output in live.handle.read().values():
                ids += list(output.generated_ids)
                logprobs += list(output.generated_log_probs)
                reason = _REASONS.get(output.finish_reason, reason)
        kept: list[int] = []
        stopped = False
        for token in ids:
            kept.append(token)
            if live.detok.add(token):
                stopped = True
                break
        if stopped:
            live.handle.stop()  # the rest of the sequence is not wanted: free it now
        ended = stopped or reason is not None or status != ov_genai.GenerationStatus.RUNNING
        if status == ov_genai.GenerationStatus.IGNORED:
            self._end(live, StepOutput("", [], finish_reason="error", error="the pipeline could not fit the prompt"))
            return
        if kept:
            self._tokens(live, len(kept), now)
        if not kept and not ended:
            return
        final = "stop" if stopped else (reason or ("length" if live.completion >= live.max_tokens else "stop"))
        step = StepOutput(
            text=live.detok.take(ended),
            token_ids=kept,
            logprobs=logprobs[: len(kept)] if live.logprobs else None,
            finish_reason=final if ended else None,
        )
        if ended:
            self._end(live, step)
        else:
            self._send(live, step)

    def _tokens(self, live: _Live, count: int, now: float) -> None:
        if live.first is None:
            live.first = now
            m.TTFT.labels(self.name).observe(now - live.arrival)
            if count > 1:
                m.ITL.labels(self.name).observe(0.0)
        elif live.last is not None:
            gap = (now - live.last) / count  # a step can give several tokens (a chunk read late)
            for _ in range(count):
                m.ITL.labels(self.name).observe(gap)
        live.last = now
        live.completion += count
        m.GENERATION_TOKENS.labels(self.name).inc(count)

    def _end(self, live: _Live, step: StepOutput) -> None:
        self._send(live, step)
        self._forget(live)
        m.REQUEST_SUCCESS.labels(self.name, step.finish_reason or "stop").inc()
        m.E2E.labels(self.name).observe(max(0.0, self._clock() - live.arrival))

    def _forget(self, live: _Live) -> None:
        if self._live.pop(live.request_id, None) is not None:
            with self._lock:
                self._active -= 1

    def _send(self, live: _Live, step: StepOutput) -> None:
        """Hand `step` over at the end of this pass (`_flush`): one wake-up of the event loop per
        pipeline step, not one per request."""
        self._outbox.setdefault(live.loop, []).append((live.out, step))

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    def _observe(self) -> None:
        """KV usage and the running/waiting gauges from the pipeline's own metrics."""
        try:
            metrics = self._pipe.get_metrics()
        except Exception:  # metrics are best effort; serving goes on
            return
        m.KV_USAGE.labels(self.name).set(float(metrics.cache_usage) / 100.0)
        m.NUM_RUNNING.labels(self.name).set(int(metrics.scheduled_requests))
        m.NUM_WAITING.labels(self.name).set(max(0, int(metrics.requests) - int(metrics.scheduled_requests)))


def _deliver(items: list[tuple[asyncio.Queue[StepOutput], StepOutput]]) -> None:
    """On the event loop: each output to its request's queue."""
    for out, step in items:
        out.put_nowait(step)


def merge(first: StepOutput, then: StepOutput) -> StepOutput:
    """Two consecutive outputs of one request as one (a consumer that fell behind takes them in one
    event: one SSE chunk instead of several, nothing delayed)."""
    logprobs = first.logprobs + then.logprobs if first.logprobs is not None and then.logprobs is not None else None
    return StepOutput(
        text=first.text + then.text,
        token_ids=first.token_ids + then.token_ids,
        logprobs=logprobs,
        finish_reason=then.finish_reason,
        error=then.error,
    )


#: the marker of an empty command queue (None is the close command)
_EMPTY = object()


def _reasons() -> dict[Any, str]:
    try:
        import openvino_genai as ov_genai
    except ImportError:
        return {}
    r = ov_genai.GenerationFinishReason
    return {r.STOP: "stop", r.LENGTH: "length"}


_REASONS = _reasons()
