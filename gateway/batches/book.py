"""Batch jobs' records in the state store, and the marks that drive them.

- the record (`kind` "batch"): OpenAI's batch object, written by the API at creation and then only
  by the process that runs the job;
- `batches:active` (batch id -> tenant): jobs not yet ended, which a runner should claim;
- `batches:cancel` (batch id -> epoch seconds): cancel requests, kept apart from the record so the
  API never races the runner's writes to it;
- `batchlines:<id>` (line index -> "<attempt>:<status>"): the lines that are done. Each is written
  in the same atomic store step as that line's settlement (usage and quota), so a line is done
  exactly when it is on the tenant's bill (see job.py).
"""

from __future__ import annotations

from gateway.batches.files import not_found
from gateway.batches.objects import BatchRecord, decode_batch, encode
from policies.stores.base import Mark, StateStore

KIND = "batch"
ACTIVE = "batches:active"
CANCEL = "batches:cancel"


def lines_key(batch_id: str) -> str:
    return f"batchlines:{batch_id}"


def line_mark(batch_id: str, index: int, attempt: str, status: int) -> Mark:
    return Mark(lines_key(batch_id), str(index), f"{attempt}:{status}")


class LineDone:
    """A done line as its mark records it: the attempt whose output counts, and its HTTP status."""

    __slots__ = ("attempt", "status")

    def __init__(self, value: str) -> None:
        attempt, _, status = value.partition(":")
        self.attempt = attempt
        self.status = int(status or 0)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


class Book:
    """Batch records and marks of one state store."""

    def __init__(self, store: StateStore) -> None:
        self._store = store

    async def create(self, tenant: str, record: BatchRecord) -> None:
        await self.save(tenant, record)
        await self._store.put_marks([Mark(ACTIVE, record.id, tenant)])

    async def save(self, tenant: str, record: BatchRecord) -> None:
        await self._store.put_record(
            KIND, record.id, tenant, record.created or record.created_at, encode(record)
        )

    async def load(self, batch_id: str) -> tuple[str, BatchRecord] | None:
        """(tenant, record) of any tenant's job (for the runner)."""
        found = await self._store.get_record(KIND, batch_id)
        return None if found is None else (found[0], decode_batch(found[1]))

    async def get(self, tenant: str, batch_id: str) -> BatchRecord:
        """The tenant's job; a 404 for a missing job and for another tenant's."""
        found = await self.load(batch_id)
        if found is None or found[0] != tenant:
            raise not_found(f"no such batch: {batch_id[:64]!r}")
        return found[1]

    async def list(self, tenant: str, after: str | None, limit: int) -> list[BatchRecord]:
        bodies = await self._store.list_records(KIND, tenant, after=after, limit=limit)
        return [decode_batch(b) for b in bodies]

    async def active(self) -> dict[str, str]:
        return await self._store.get_marks(ACTIVE)

    async def cancels(self) -> dict[str, int]:
        return {k: int(float(v)) for k, v in (await self._store.get_marks(CANCEL)).items()}

    async def request_cancel(self, batch_id: str, now: float) -> None:
        await self._store.put_marks([Mark(CANCEL, batch_id, repr(now))])

    async def lines_done(self, batch_id: str) -> dict[int, LineDone]:
        return {int(k): LineDone(v) for k, v in (await self._store.get_marks(lines_key(batch_id))).items()}

    async def ended(self, batch_id: str) -> None:
        """The job reached its end: nothing is left to run or to cancel; its line marks go too."""
        await self._store.drop_marks(ACTIVE, [batch_id])
        await self._store.drop_marks(CANCEL, [batch_id])
        await self._store.drop_marks(lines_key(batch_id))
