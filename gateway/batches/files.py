"""Files of the Batch API: bodies in the configured directory, metadata in the state store.

A body is written to a temporary name, flushed to disk and renamed into place before its record is
stored, so a record never points at a partial body (a crash leaves at most an unreferenced
temporary file). Every read checks the owning tenant: another tenant's file does not exist.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from gateway.batches.objects import FileObject, decode_file, encode, new_id
from gateway.errors import GatewayError
from policies.stores.base import StateStore

KIND = "file"


def not_found(message: str) -> GatewayError:
    """A 404 in the caller's envelope: a missing object and another tenant's answer alike."""
    return GatewayError(404, "not_found", message)


class Files:
    """The tenant-scoped file service."""

    def __init__(self, store: StateStore, directory: str) -> None:
        self._store = store
        self.directory = Path(directory)

    def path(self, file_id: str) -> Path:
        # ids are made here (random hex, or a job's fixed names); a record is looked up before any
        # path is built from a URL, and this refuses anything that could leave the directory
        if "/" in file_id or "\\" in file_id or file_id.startswith("."):
            raise not_found(f"no such file: {file_id[:64]!r}")
        return self.directory / file_id

    async def create(
        self, tenant: str, filename: str, purpose: str, data: bytes, now: float, file_id: str | None = None
    ) -> FileObject:
        """Store a file's body and record; `file_id` (a job's output) makes a rewrite idempotent."""
        file_id = file_id or new_id("file-")
        await asyncio.to_thread(self._write, file_id, data)
        obj = FileObject(id=file_id, bytes=len(data), created_at=int(now), filename=filename, purpose=purpose)
        await self._store.put_record(KIND, file_id, tenant, now, encode(obj))
        return obj

    def _write(self, file_id: str, data: bytes) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # prompts and answers: owner only
        final = self.path(file_id)
        temporary = final.with_name(final.name + ".part")
        with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, final)

    async def get(self, tenant: str, file_id: str) -> FileObject:
        """The tenant's file; a 404 for a missing file and for another tenant's."""
        found = await self._store.get_record(KIND, file_id)
        if found is None or found[0] != tenant:
            raise not_found(f"no such file: {file_id[:64]!r}")
        return decode_file(found[1])

    async def content(self, tenant: str, file_id: str) -> bytes:
        await self.get(tenant, file_id)
        try:
            return await asyncio.to_thread(self.path(file_id).read_bytes)
        except FileNotFoundError:
            raise not_found(f"the content of file {file_id!r} is gone") from None

    async def list(self, tenant: str, after: str | None, limit: int) -> list[FileObject]:
        return [
            decode_file(b) for b in await self._store.list_records(KIND, tenant, after=after, limit=limit)
        ]

    async def delete(self, tenant: str, file_id: str) -> None:
        await self.get(tenant, file_id)
        await self._store.delete_record(KIND, file_id)
        await asyncio.to_thread(self.path(file_id).unlink, missing_ok=True)
