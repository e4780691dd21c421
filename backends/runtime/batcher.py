"""Dynamic batching shared by tensor backends.

Concurrent requests are merged along dimension 0, run once and split back. Small models are
dominated by per-call overhead, so one call on 32 rows costs little more than one call on 1 row.

Only requests that can be concatenated go into one batch: same input names, dtypes and trailing
dimensions, and the same requested outputs. A batch that fails is retried one request at a time so
that a request the runtime rejects does not fail its batch-mates (the run of a batch: `batches.py`).

Several batches may run at once, up to `max_in_flight`: a runtime with parallel slots (OpenVINO's
THROUGHPUT streams, ONNX Runtime sessions called from several threads) would otherwise idle all
but one of them while the batcher waits for the running batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

from backends.base import BatchObserver, TensorSpec
from backends.errors import BackendUnavailable
from backends.runtime.batches import Arrays, Pending, RunBatch, execute_batch
from backends.spec import BatchingSpec

log = structlog.get_logger(__name__)

#: single-request batches in a row after which a lone request goes through `run_alone`
SEQUENTIAL_RUNS = 8


class DynamicBatcher:
    """Merges concurrent requests into batches of up to `max_batch_size` rows.

    With `wait_for_company=False` (the `continuous` mode) it never waits on a timer: a request that
    finds a free slot runs at once, and requests arriving while every slot is busy gather in the
    queue and run together when a slot frees. With `wait_for_company=True` (the `delay` mode) the
    first request of a batch may also wait up to `max_delay_ms` for company. In that mode a lone
    caller is not made to wait either: the delay applies once requests have been seen overlapping
    (the previous batch merged several, or several are queued now), and it ends early once as many
    requests are queued as the last batch held. Requests that arrive while every slot is busy
    gather in the queue; when several slots are free, the queued rows are shared out over them.

    Args:
        run: coroutine that runs one batch (it must not block the event loop for long: backends run
            only calls measured fast on the loop's own thread, `backends/runtime/inline_runs.py`).
        max_batch_size: most rows in one merged batch; a larger request runs alone.
        max_delay_ms: how long the first request of a batch waits for company.
        max_queue: requests waiting beyond this are refused with BackendUnavailable.
        observer: optional callback for metrics.
        max_in_flight: batches that may run at the same time (the runtime's parallel slots).
        wait_for_company: the `delay` mode (see above); False is the `continuous` mode.
        run_alone: runs a request that would start alone at once (nothing queued, a slot free, no
            company expected): it skips the queue and runs in its caller's task, through this
            callable when given (a backend may run such a call inline, `backends/runtime/inline_runs.py`).
    """

    def __init__(
        self,
        run: RunBatch,
        *,
        max_batch_size: int,
        max_delay_ms: float,
        max_queue: int,
        observer: BatchObserver | None = None,
        max_in_flight: int = 1,
        wait_for_company: bool = True,
        run_alone: RunBatch | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self._run = run
        self._run_alone = run_alone or run
        self.max_batch_size = max_batch_size
        self.max_delay_s = max_delay_ms / 1000.0
        self.max_queue = max_queue
        self.max_in_flight = max_in_flight
        self.wait_for_company = wait_for_company
        self._observer = observer
        self._queue: list[Pending] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        #: batches running now (each holds one of the runtime's parallel slots)
        self._running: set[asyncio.Task[None]] = set()
        #: lone requests running now in their callers' tasks (`_run_direct`), each holding a slot
        self._direct_running = 0
        #: a request is yielding once before it runs alone (`submit`); others arriving now queue
        self._lone_candidate = False
        self._closed = False
        #: requests in the last batch started; 1 means callers are not overlapping right now
        self._last_batch_requests = 1
        #: batches in a row, up to now, that held a single request (callers coming one at a time)
        self._lone_streak = 0
        #: event-loop time when the last batch finished (its callers come back soon after)
        self._last_finished = float("-inf")
        #: event-loop time when a queued caller last resumed with its result. A batch's callers
        #: resume one after another, each answering its client before the next runs, so with 32
        #: callers the last answer leaves ~10 ms after the run ended: their next requests come
        #: back within max_delay of that, not of the run's end.
        self._last_resumed = float("-inf")

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        """Batches running now (a lone request run at once in its caller's task counts as one)."""
        return len(self._running) + self._direct_running

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="dynamic-batcher")

    async def close(self) -> None:
        """Answer every queued and batched caller with BackendUnavailable and refuse new ones. A
        lone request already running in its caller's task finishes its run."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        running = list(self._running)
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        for pending in self._queue:
            if not pending.future.done():
                pending.future.set_exception(BackendUnavailable("the deployment is shutting down"))
        self._queue.clear()

    async def submit(self, inputs: Arrays, outputs: tuple[str, ...] | None) -> Arrays:
        """Queue one request; returns its own slice of the batch's outputs."""
        if self._closed:
            raise BackendUnavailable("the deployment is shutting down")
        if len(self._queue) + self._lone_candidate >= self.max_queue:
            raise BackendUnavailable("the batch queue of this deployment is full", retry_after_s=1.0)
        rows = int(next(iter(inputs.values())).shape[0]) if inputs else 1
        first = False
        if self._runs_at_once():
            # Requests that arrived together (one read of several connections) are all ready to
            # run in this loop iteration: yield once so they queue, then run alone only if none did.
            self._lone_candidate = True
            try:
                await asyncio.sleep(0)
            finally:
                self._lone_candidate = False
                self._wakeup.set()  # the batcher's task waits while a candidate yields
            if self._closed:
                raise BackendUnavailable("the deployment is shutting down")
            if self._runs_at_once():
                return await self._run_direct(inputs, outputs, rows)
            first = True
        self.start()
        pending = Pending(inputs, outputs, rows, asyncio.get_running_loop().create_future())
        if first:
            self._queue.insert(0, pending)  # it came before the ones that queued while it yielded
        else:
            self._queue.append(pending)
        self._wakeup.set()
        loop = asyncio.get_running_loop()
        result = await pending.future
        self._last_resumed = loop.time()  # a caller answered (not one cancelled or failed)
        return result

    def _runs_at_once(self) -> bool:
        """Whether a request would start alone at once if queued: nothing waits, a slot is
        free and no company is expected (see `_loop`). Such a request skips the queue and the
        batcher's task: it runs in its caller's own task, which saves the hand-offs between tasks
        (a lone caller's latency) and leaves the batch it would have formed unchanged."""
        if self._queue or self._lone_candidate or self.in_flight >= self.max_in_flight:
            return False
        return not (self.wait_for_company and self._callers_returning())

    def _callers_returning(self) -> bool:
        """The last batch merged several requests and ended, or last answered one of its callers,
        less than max_delay ago: closed-loop callers are on their way back, so company is coming."""
        if self._last_batch_requests <= 1:
            return False
        now = asyncio.get_running_loop().time()
        return now - max(self._last_finished, self._last_resumed) <= self.max_delay_s

    async def _run_direct(self, inputs: Arrays, outputs: tuple[str, ...] | None, rows: int) -> Arrays:
        """Run a lone request as a batch of its own in the caller's task, holding a slot meanwhile.

        It goes through `run_alone` only once the last `SEQUENTIAL_RUNS` batches each held a single
        request (they may have run side by side on several slots: the streak says no batch merged
        callers lately, not that only one caller exists). Without the streak, callers that overlap
        now and then (8 in flight on a 3 ms model: one run in nine was lone) found the loop held by
        an inline run each time, their own work queued behind it: 0.90x requests/s in
        `bench/bench_lone_inline.py`, 1.04x with it."""
        run = self._run_alone if self._lone_streak >= SEQUENTIAL_RUNS else self._run
        if self._observer is not None:
            self._observer(1, rows)
        self._direct_running += 1
        self._last_batch_requests = 1
        self._lone_streak += 1
        try:
            return await run(inputs, outputs)
        finally:
            # A caller cancelled meanwhile (its deadline) frees the slot at once, though a worker
            # may still be running its call: the runtime's own threads still bound its runs.
            self._direct_running -= 1
            self._last_finished = asyncio.get_running_loop().time()
            self._wakeup.set()  # a slot is free for what queued meanwhile

    def _take_batch(self, row_cap: int) -> list[Pending]:
        """Pop the oldest live request and every queued request compatible with it, up to `row_cap` rows."""
        while self._queue and self._queue[0].future.done():  # cancelled by its caller
            self._queue.pop(0)
        if not self._queue:
            return []
        first = self._queue.pop(0)
        batch, rows, keep = [first], first.rows, []
        for pending in self._queue:
            fits = pending.key == first.key and rows + pending.rows <= row_cap
            if fits and not pending.future.done():
                batch.append(pending)
                rows += pending.rows
            elif not pending.future.done():
                keep.append(pending)
        self._queue = keep
        return batch

    def _queued_rows(self, key: tuple) -> int:
        return sum(p.rows for p in self._queue if p.key == key)

    async def _wait_for_slot(self) -> None:
        """Until fewer than `max_in_flight` batches run (a finishing batch sets the wakeup)."""
        while self.in_flight >= self.max_in_flight:
            self._wakeup.clear()
            await self._wakeup.wait()

    async def _loop(self) -> None:
        while True:
            # A request yielding before it runs alone (`submit`) is first in line: what queued
            # meanwhile waits for it to join, so one batch takes them all.
            if not self._queue or self._lone_candidate:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            # Requests that arrive while every slot is busy gather in the queue meanwhile.
            await self._wait_for_slot()
            if not self._queue:
                continue
            first = self._queue[0]
            free = self.max_in_flight - self.in_flight
            # Wait for company only when callers have been overlapping (the last batch merged
            # several requests): a lone caller would otherwise pay max_delay_ms on every request.
            # With several slots free and company already queued, start now: the rows are split
            # over the free slots below, and waiting would only idle them.
            spread = free > 1 and len(self._queue) > 1
            # Callers overlap when several are queued now, or when the last batch merged several
            # and ended just now (closed-loop callers are on their way back). A request arriving
            # after a burst ended finds the runtime idle for longer than max_delay and runs at once.
            overlapping = self._callers_returning() or len(self._queue) > 1
            wait = self.wait_for_company and not spread and overlapping
            deadline = asyncio.get_running_loop().time() + (self.max_delay_s if wait else 0.0)
            # ...and only until as many requests are back as the last batch held: closed-loop
            # callers return together, and waiting longer for them would idle the runtime.
            while (
                self._queued_rows(first.key) < self.max_batch_size
                and len(self._queue) < self._last_batch_requests
            ):
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    break
            # Closed-loop callers all come back together when their batch ends; taking them all
            # into one batch would leave the other slots idle (OpenVINO THROUGHPUT: half the
            # streams), so the queued rows are shared out over the free slots.
            share = min(self.max_batch_size, max(1, -(-self._queued_rows(first.key) // free)))  # ceil
            for _ in range(free):
                batch = self._take_batch(share)
                if not batch:
                    break
                self._start(batch)

    def _start(self, batch: list[Pending]) -> None:
        """Run one batch as its own task, holding a slot until it finishes."""
        self._last_batch_requests = len(batch)
        self._lone_streak = self._lone_streak + 1 if len(batch) == 1 else 0
        if self._observer is not None:
            self._observer(len(batch), sum(p.rows for p in batch))
        task = asyncio.get_running_loop().create_task(self._execute(batch), name="dynamic-batch")
        self._running.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._free_slot(task)  # already done by `_execute` unless the task never started
        if task.cancelled():  # close(): nobody will answer these callers otherwise
            return
        exc = task.exception()
        if exc is not None:  # _execute hands every error to its callers; this is a bug guard
            log.error("batch_task_failed", error=repr(exc))

    def _free_slot(self, task: asyncio.Task[Any] | None) -> None:
        if task in self._running:
            self._running.discard(task)
            self._last_finished = asyncio.get_running_loop().time()
            self._wakeup.set()  # a slot is free

    async def _execute(self, batch: list[Pending]) -> None:
        try:
            await execute_batch(self._run, batch)
        except asyncio.CancelledError:
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(BackendUnavailable("the deployment is shutting down"))
            raise
        finally:
            # The slot is free before the callers, woken by their results, run again: one that
            # submits its next request at once must see it free (the task's done callback, the
            # only release before, came after them, so a sequential caller always found the
            # only slot taken and queued).
            self._free_slot(asyncio.current_task())


def batcher_for(
    deployment: str,
    batching: BatchingSpec | None,
    specs: list[TensorSpec],
    run: RunBatch,
    observer: Callable[[], BatchObserver | None],
    max_in_flight: int = 1,
    run_alone: RunBatch | None = None,
) -> DynamicBatcher | None:
    """The dynamic batcher a tensor backend should use, or None.

    None when the config asks for no batching, or when some input or output has a fixed dimension 0
    (rows cannot be merged along it). `observer` is read at each batch, so the gateway may attach
    its metrics hook after the backend is built. `max_in_flight` is the runtime's number of
    parallel slots: that many batches may run at once. `run_alone` runs a lone request (see
    `DynamicBatcher`).
    """
    if batching is None:
        return None
    if not all(s.shape and s.shape[0] == -1 for s in specs):
        log.warning("batching_disabled_fixed_batch_dim", deployment=deployment)
        return None

    def observe(requests: int, rows: int) -> None:
        hook = observer()
        if hook is not None:
            hook(requests, rows)

    return DynamicBatcher(
        run,
        max_batch_size=batching.max_batch_size,
        max_delay_ms=batching.max_delay_ms,
        max_queue=batching.max_queue,
        observer=observe,
        max_in_flight=max_in_flight,
        wait_for_company=batching.mode == "delay",
        run_alone=run_alone,
    )
