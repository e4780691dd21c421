"""Drives an `LLMEngine` from one dedicated thread and streams its outputs to asyncio tasks.

The event loop never runs a model step: `add` and `abort` only enqueue commands and wake the thread;
the thread applies commands between steps (so an abort frees its blocks before the next step is
scheduled) and hands each step's outputs back with one `call_soon_threadsafe` per event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from backends.base import SamplingParams
from backends.torch_llm.engine import LLMEngine, RequestOutput
from backends.torch_llm.structured.grammar import CompiledGrammar

log = structlog.get_logger(__name__)
T = TypeVar("T")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


class AsyncLLMEngine:
    """Thread-backed engine loop.

    Args:
        engine: the synchronous engine; only this object's thread touches it after `start()`.
        name: used for the thread name and logs.
    """

    def __init__(self, engine: LLMEngine, *, name: str = "llm") -> None:
        self.engine = engine
        self.name = name
        self._commands: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"torch-llm-{name}", daemon=True)
        sched = engine.scheduler
        self._capacity = (sched.max_num_seqs, sched.block_manager.num_free_blocks)

    # --- called from the event loop ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    async def close(self) -> None:
        """Stop the thread; streams still open end with finish_reason "abort"."""
        self._closed = True
        self._wake.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join)

    @property
    def capacity(self) -> tuple[int, int]:
        """(free sequence slots, free KV blocks), as of the last step."""
        return self._capacity

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_scope: str,
        adapter: str | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> asyncio.Queue[RequestOutput]:
        """Queue a request; its outputs arrive on the returned queue, the last one has a finish_reason.

        Raises:
            ValueError: a request with this id is still active.
        """
        if self._closed:
            raise RuntimeError("engine is closed")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already active")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream

        def command() -> None:
            try:
                self.engine.add_request(
                    request_id, prompt_token_ids, params, cache_scope=cache_scope, adapter=adapter,
                    grammar=grammar,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - reported on the request's own stream
                log.warning("llm_add_failed", request_id=request_id, error=str(exc))
                self._finish_stream(request_id, "error", f"the request was refused: {exc}")

        self._submit(command)
        return stream.queue

    async def abort(self, request_id: str) -> None:
        """Abort a request and wait until the engine thread has freed its blocks."""
        done = asyncio.get_running_loop().create_future()

        def command() -> None:
            self.engine.abort(request_id)
            self._finish_stream(request_id, "abort")
            _post(done.get_loop(), lambda: done.done() or done.set_result(None))

        self._submit(command)
        if self._thread.is_alive():
            await done

    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps and return its result (or raise
        its exception): how state the thread owns (the adapters) is changed from the event loop."""
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                failure = exc
                _post(done.get_loop(), lambda: done.done() or done.set_exception(failure))
            else:
                _post(done.get_loop(), lambda: done.done() or done.set_result(result))

        if not self._thread.is_alive():
            return fn(self.engine)
        self._submit(command)
        return await done

    def abort_nowait(self, request_id: str) -> None:
        """Abort without waiting (safe from a generator's cleanup)."""
        self._streams.pop(request_id, None)
        self._submit(lambda: self.engine.abort(request_id))

    # --- the engine thread ---------------------------------------------------------------------

    def _submit(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._commands.append(command)
        self._wake.set()

    def _run(self) -> None:
        while True:
            with self._lock:
                commands, self._commands = self._commands, []
            for command in commands:
                command()
            if self._closed:
                for request_id in list(self._streams):
                    self.engine.abort(request_id)
                    self._finish_stream(request_id, "abort")
                return
            if not self.engine.has_unfinished:
                self._update_capacity()
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception:  # noqa: BLE001 - a failed step fails its requests, not the thread
                # The engine confines failures of requests to those requests (LLMEngine.step); what
                # reaches here is the engine's own state failing, so nothing running can be trusted.
                log.exception("llm_step_failed", deployment=self.name)
                self._fail_all()
                continue
            self._update_capacity()
            self._deliver(outputs)

    def _update_capacity(self) -> None:
        sched = self.engine.scheduler
        busy = len(sched.running) + len(sched.waiting)
        self._capacity = (max(0, sched.max_num_seqs - busy), sched.block_manager.num_free_blocks)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[
            asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]
        ] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finish_reason is not None:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            _post(loop, _put_all, items)

    def _finish_stream(self, request_id: str, reason: str, error: str | None = None) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            final = RequestOutput(
                request_id=request_id, token_ids=[], text="", finish_reason=reason, error=error
            )
            _post(stream.loop, stream.queue.put_nowait, final)

    def _fail_all(self) -> None:
        for request_id in list(self._streams):
            self.engine.abort(request_id)
            self._finish_stream(request_id, "error")


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]) -> None:
    for queue, out in items:
        queue.put_nowait(out)
