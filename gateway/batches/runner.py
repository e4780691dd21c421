"""The background task that finds batch jobs to run, claims each for this process, and runs it.

Every `poll_interval_s` the runner reads the active jobs (`batches:active`) and claims those that no
process runs: a claim is a one-slot lease in the state store (`batchrun:<id>`), renewed while the job
runs and gone `claim_ttl_s` after its process dies, so with several replicas (or workers) sharing a
store each job runs in one process at a time, and a job whose process was killed is resumed by the
next one to look (this process, restarted, included).
"""

from __future__ import annotations

import asyncio
import secrets

import structlog

from gateway.batches.job import Job, JobContext, JobPaused
from policies.errors import StoreUnavailable
from policies.stores.base import LeaseOp, StateStore

log = structlog.get_logger(__name__)


class Runner:
    """Claims and runs this process's share of the batch jobs."""

    def __init__(self, ctx: JobContext, store: StateStore) -> None:
        self.ctx = ctx
        self._store = store
        self._jobs: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        #: a scan started by `wake` (held so it is not garbage-collected mid-way)
        self._waking: asyncio.Future[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="fleetgate-batches")

    async def stop(self) -> None:
        """Stop looking and stop the running jobs (their open lines resume elsewhere or later),
        giving their claims back so that a restarted process resumes them at once."""
        tasks = [t for t in (self._task, self._waking, *self._jobs.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def wake(self) -> None:
        """A job was created here: look now instead of at the next poll."""
        if self._task is not None and not self._task.done() and self._waking is None:
            self._waking = asyncio.ensure_future(self._scan())
            self._waking.add_done_callback(self._woken)

    def _woken(self, task: asyncio.Future[None]) -> None:
        self._waking = None
        if not task.cancelled() and task.exception() is not None:
            log.warning("batches_scan_failed", error=str(task.exception()))

    async def _loop(self) -> None:
        while True:
            try:
                await self._scan()
                await self._renew()
            except StoreUnavailable as exc:
                log.warning("batches_store_unavailable", error=exc.detail)
            except Exception:  # noqa: BLE001 - the runner must outlive any one failure
                log.exception("batches_runner_failed")
            await asyncio.sleep(self.ctx.config.poll_interval_s)

    async def _scan(self) -> None:
        if self.ctx.core().drain.draining:  # a draining gateway takes on no new work
            return
        for batch_id in await self.ctx.book.active():
            if len(self._jobs) >= self.ctx.config.max_running_jobs:
                return  # the others wait for a free turn here, or for another replica
            if batch_id not in self._jobs and await self._claim(batch_id):
                self._jobs[batch_id] = asyncio.create_task(self._run(batch_id), name=f"batch-{batch_id}")

    def _lease(self, batch_id: str) -> tuple[str, str]:
        return f"batchrun:{batch_id}", f"{self.ctx.instance}.{batch_id}"

    async def _claim(self, batch_id: str) -> bool:
        key, lease_id = self._lease(batch_id)
        result = await self._store.acquire(
            lease_id=lease_id,
            lease_ttl_s=self.ctx.config.claim_ttl_s,
            buckets=[],
            leases=[LeaseOp(key, 1)],
            counters=[],
            now=self.ctx.clock(),
        )
        return result.ok

    async def _renew(self) -> None:
        now = self.ctx.clock()
        for batch_id in list(self._jobs):
            key, lease_id = self._lease(batch_id)
            await self._store.renew(lease_id=lease_id, keys=[key], ttl_s=self.ctx.config.claim_ttl_s, now=now)

    async def _run(self, batch_id: str) -> None:
        try:
            found = await self.ctx.book.load(batch_id)
            if found is None:  # deleted under it: nothing to run
                await self.ctx.book.ended(batch_id)
                return
            await Job(self.ctx, found[0], found[1]).run()
        except asyncio.CancelledError:
            raise
        except JobPaused:
            log.info("batch_paused_for_drain", batch=batch_id)
        except Exception:  # noqa: BLE001 - the job is retried at a later poll
            log.exception("batch_job_failed", batch=batch_id)
        finally:
            self._jobs.pop(batch_id, None)
            await asyncio.shield(self._release(batch_id))

    async def _release(self, batch_id: str) -> None:
        key, lease_id = self._lease(batch_id)
        try:
            await self._store.settle(
                settle_id=f"{lease_id}.{secrets.token_hex(6)}",
                lease_id=lease_id,
                buckets=[],
                release=[key],
                counters=[],
                usage=[],
                now=self.ctx.clock(),
            )
        except StoreUnavailable:  # the claim lapses by itself
            pass
