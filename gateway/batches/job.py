"""One batch job, from where it stands to its end: run the lines not done yet, then its output files.

Exactly-once billing (the guarantee, also in docs/batches.md): each line runs as a background request
whose settlement (usage record, quota adjustment) the admission does not apply but hands over
(`policies.held_settle`). When the line has its answer, the job appends the result to its part file
(flushed) and then commits the settlement and the line's done mark in one atomic store step. So:

- a line is marked done if and only if its settlement is applied: never billed twice, never done
  without being billed;
- a process killed before that step leaves the line not done (it runs again on resume; its first
  attempt's reservation is journaled and refunded by `Admission.recover`, like any request of a dead
  process, and never recorded as usage);
- a process killed after it leaves the line done, and its result in the part file.

A line may therefore reach the backend twice (once per process that died running it), but appears
once in the output and once on the bill. Within a live process a line runs once: workers take a line
only after their last await (two workers never race for the last one), and a worker's unexpected
error lets the others finish the line each holds instead of cutting it (a cut line would run again
when the job resumes, and its reservation would stay with this live process).
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from gateway.batches import results
from gateway.batches.book import Book, line_mark
from gateway.batches.config import BatchesConfig
from gateway.batches.dispatch import LineAnswer, run_line
from gateway.batches.files import Files
from gateway.batches.input import Request, parse_input
from gateway.batches.objects import TERMINAL, BatchError, BatchErrors, BatchRecord, RequestCounts
from gateway.core.service import GatewayCore
from policies.admission import Admission
from policies.errors import StoreUnavailable
from policies.held_settle import HeldSettle
from policies.principal import Principal
from policies.stores.base import Mark
from policies.types import Budget

log = structlog.get_logger(__name__)

#: how long the refund of a line cut by a shutdown may wait for its settlement (the shutdown waits)
REFUND_WAIT_S = 5.0


@dataclass
class JobContext:
    """What every job of a process shares."""

    core: Callable[[], GatewayCore]
    admission: Admission
    book: Book
    files: Files
    config: BatchesConfig
    clock: Callable[[], float]
    #: names this process's part files
    instance: str

    def workdir(self, batch_id: str) -> Path:
        return self.files.directory / "jobs" / batch_id


class JobPaused(Exception):
    """This gateway drains: the job stops with its open lines open (another process, or this one
    restarted, resumes it once its claim is given back)."""


class Job:
    """Runs one batch job (see the module docstring for what survives a crash)."""

    def __init__(self, ctx: JobContext, tenant: str, record: BatchRecord) -> None:
        self.ctx = ctx
        self.tenant = tenant
        self.record = record
        #: why the job stops early: "cancelled" or "expired" (None: it runs to the end)
        self.stop: str | None = None
        self._part = results.PartFile(ctx.workdir(record.id), f"{ctx.instance}-{secrets.token_hex(4)}")
        self._counts = RequestCounts()
        self._saved_counts = RequestCounts()
        #: the owner key's own budget, once read (a 1-tuple: its value may be None)
        self._owner_budget_read: tuple[Budget | None] | None = None
        #: a worker failed unexpectedly: the others take no new line (the job resumes at a later poll)
        self._halted = False

    async def run(self) -> None:
        if self.record.status in TERMINAL:
            await self.ctx.book.ended(self.record.id)
            return
        requests = await self._requests()
        if requests is None:
            return
        if self.record.status == "validating":
            self.record.status = "in_progress"
            self.record.in_progress_at = int(self.ctx.clock())
            self.record.request_counts = RequestCounts(total=len(requests))
            await self.ctx.book.save(self.tenant, self.record)
        done = await self.ctx.book.lines_done(self.record.id)
        self._counts = RequestCounts(
            total=len(requests),
            completed=sum(d.ok for d in done.values()),
            failed=sum(not d.ok for d in done.values()),
        )
        pending = deque(r for r in requests if r.index not in done)
        log.info(
            "batch_running", batch=self.record.id, tenant=self.tenant, left=len(pending), total=len(requests)
        )
        await self._check_stop()
        try:
            workers = [
                asyncio.create_task(self._work(pending))
                for _ in range(min(self.ctx.config.concurrency, len(pending)))
            ]
            await self._watch(workers)
        finally:
            self._part.close()
        await self._finalize(requests)

    async def _requests(self) -> list[Request] | None:
        """The job's requests, from its input file; a file gone since creation fails the job."""
        try:
            data = await self.ctx.files.content(self.tenant, self.record.input_file_id)
            return await asyncio.to_thread(parse_input, data, self.ctx.config.max_lines)
        except StoreUnavailable:
            raise  # an outage is no reason to fail the job: it is tried again at a later poll
        except Exception as exc:  # noqa: BLE001 - any reason the input cannot be read fails the job
            message = getattr(exc, "message", None) or str(exc)
            self.record.errors = BatchErrors([BatchError(code="invalid_input_file", message=message)])
            await self._end("failed")
            return None

    async def _check_stop(self) -> None:
        if self.record.id in await self.ctx.book.cancels():
            self.stop = "cancelled"
        elif self.ctx.clock() >= self.record.expires_at:
            self.stop = "expired"

    async def _watch(self, workers: list[asyncio.Task[None]]) -> None:
        """Until the workers end: look for a cancel or the window's end, and save the counts."""
        try:
            while running := [w for w in workers if not w.done()]:
                await asyncio.wait(
                    running, timeout=self.ctx.config.poll_interval_s, return_when=asyncio.FIRST_EXCEPTION
                )
                if any(w.done() and not w.cancelled() and w.exception() is not None for w in workers):
                    # the others end with the line they hold done and committed, not cut mid-way
                    self._halted = True
                try:
                    if self.stop is None:
                        await self._check_stop()
                    await self._save_counts()
                except StoreUnavailable as exc:
                    # looked at again at the next poll: ending the job here would cut the lines in
                    # flight, which then run a second time when the job resumes
                    log.warning("batch_watch_retry", batch=self.record.id, error=exc.detail)
            for w in workers:
                w.result()  # a worker's unexpected error ends the job here (it resumes later)
        finally:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)

    async def _save_counts(self) -> None:
        if self._counts != self._saved_counts:
            counts = RequestCounts(self._counts.total, self._counts.completed, self._counts.failed)
            self.record.request_counts = counts
            await self.ctx.book.save(self.tenant, self.record)
            self._saved_counts = counts  # only once saved: a failed save is tried at the next poll

    async def _work(self, pending: deque[Request]) -> None:
        while pending and self.stop is None and not self._halted:
            if self.ctx.clock() >= self.record.expires_at:
                self.stop = "expired"
                return
            if self.record.owner_key and not await self.ctx.core().identity.still_valid(self.record.owner_key):
                # a revoked (say, leaked) key stops spending the tenant's quota, in batches too
                message = f"the API key {self.record.owner_key} that created this batch was revoked or expired"
                self.record.errors = BatchErrors([BatchError(code="key_revoked", message=message)])
                self.stop = "failed"
                return
            # the key check above may have waited (a store lookup): another worker may have taken
            # the last line meanwhile, so the line is taken only now, after the last await
            if not pending or self.stop is not None or self._halted:
                return
            await self._run_one(pending.popleft())

    async def _run_one(self, request: Request) -> None:
        executed = await self._execute(request)
        if executed is None:  # the job stops (cancel, expiry): the line stays open
            return
        held, answer = executed
        attempt = secrets.token_hex(8)
        self._part.append(request.index, attempt, results.output_line(request, answer))
        await self._commit(held, [line_mark(self.record.id, request.index, attempt, answer.status)])
        if 200 <= answer.status < 300:
            self._counts.completed += 1
        else:
            self._counts.failed += 1

    async def _owner_budget(self) -> Budget | None:
        """The owner key's own budget, which bounds its batch lines as it bounds its requests (the
        tenant's budget applies through the tenant); read once per job run."""
        if self._owner_budget_read is None:
            key = self.record.owner_key
            self._owner_budget_read = (await self.ctx.core().keys.budget_of(key) if key else None,)
        return self._owner_budget_read[0]

    async def _execute(self, request: Request) -> tuple[HeldSettle, LineAnswer] | None:
        """Run the line, again after a transient refusal (backing off), up to `max_retries` times.

        A 504 (the line's deadline passed, most often while it waited its turn behind interactive
        traffic, which the background class lets go first) is not counted: such a line waits for
        idle capacity until the job's window ends. None when the job stops meanwhile (the line stays
        open). A refusal while this gateway drains is never the line's answer: the job pauses
        (`JobPaused`) and resumes elsewhere or after the restart."""
        counted = 0
        while True:
            held = HeldSettle()
            principal = Principal(
                self.tenant,
                self.record.owner_key,
                tuple(self.record.owner_models),
                background=held,
                budget=await self._owner_budget(),
            )
            try:
                answer = await run_line(self.ctx.core(), principal, request)
            except asyncio.CancelledError:
                # this process stops the job (shutdown): the line stays open and runs again when
                # the job resumes, so what this attempt reserved goes back now (a process that
                # lives on is never taken for dead, and `Admission.recover` would never refund it)
                self.ctx.core().settlement.hold(asyncio.ensure_future(self._refund(held)))
                raise
            if not answer.transient:
                return held, answer
            if self.ctx.core().drain.draining:
                await self._commit(held, [])  # the refused attempt's refund, on no line's record
                raise JobPaused(self.record.id)
            if answer.status != 504:
                counted += 1
            if counted > self.ctx.config.max_retries:
                return held, answer
            await self._commit(held, [])
            if self.stop is not None or self.ctx.clock() >= self.record.expires_at:
                return None
            await asyncio.sleep(min(0.5 * 2 ** min(counted, 5), 10.0))

    async def _commit(self, held: HeldSettle, marks: list[Mark]) -> None:
        """Commit a settlement with its marks; a store outage is waited out (the line stays open)."""
        delay = 0.2
        while True:
            try:
                await self.ctx.admission.commit(held, marks)
                return
            except StoreUnavailable as exc:
                log.warning("batch_commit_retry", batch=self.record.id, error=exc.detail)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _refund(self, held: HeldSettle) -> None:
        """Commit a cut attempt's settlement (a refund) on no line's record, once, briefly."""
        try:
            await asyncio.wait_for(self.ctx.admission.commit(held, []), REFUND_WAIT_S)
        except (TimeoutError, StoreUnavailable) as exc:
            log.warning("batch_refund_failed", batch=self.record.id, error=str(exc))

    async def _finalize(self, requests: list[Request]) -> None:
        """Write the output and error files from the committed lines, then end the job."""
        outcome = self.stop or "completed"
        now = int(self.ctx.clock())
        self.record.status = "finalizing"
        self.record.finalizing_at = self.record.finalizing_at or now
        await self.ctx.book.save(self.tenant, self.record)
        done = await self.ctx.book.lines_done(self.record.id)
        workdir = self.ctx.workdir(self.record.id)
        entries = await asyncio.to_thread(results.read_parts, workdir)
        output, errors = results.assemble(requests, done, entries, expired=outcome == "expired")
        # fixed ids: a finalization cut by a crash and run again writes the same files
        if output:
            self.record.output_file_id = await self._write_file("output", output, now)
        if errors:
            self.record.error_file_id = await self._write_file("errors", errors, now)
        completed = sum(d.ok for d in done.values())
        self.record.request_counts = RequestCounts(len(requests), completed, len(errors))
        await self._end(outcome)
        await asyncio.to_thread(results.remove_parts, workdir)

    async def _write_file(self, kind: str, lines: list[bytes], now: int) -> str:
        file_id = f"file-{self.record.id.removeprefix('batch_')}-{kind}"
        data = b"\n".join(lines) + b"\n"
        await self.ctx.files.create(
            self.tenant, f"{self.record.id}_{kind}.jsonl", "batch_output", data, now, file_id
        )
        return file_id

    async def _end(self, status: str) -> None:
        now = int(self.ctx.clock())
        self.record.status = status  # type: ignore[assignment]
        setattr(self.record, f"{status}_at", now)
        if status == "cancelled":
            self.record.cancelling_at = self.record.cancelling_at or (await self.ctx.book.cancels()).get(
                self.record.id
            )
        await self.ctx.book.save(self.tenant, self.record)
        await self.ctx.book.ended(self.record.id)
        log.info(
            "batch_ended",
            batch=self.record.id,
            tenant=self.tenant,
            status=status,
            counts=self.record.request_counts,
        )
