"""Files of the Batch API: bodies in the configured directory, metadata in the state store.

A body is written to a temporary name, flushed to disk and renamed into place before its record is
stored, so a record never points at a partial body (a crash leaves at most an unreferenced
temporary file). An upload is written as it arrives (`Upload`), never held whole in memory. Every
read checks the owning tenant: another tenant's file does not exist. The bytes each tenant stores
are counted (`quota.StoredBytes`): a job's files when written, an upload by its route, and a
deleted file's bytes are freed.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from fleetgate.errors import GatewayError
from gateway.batches.input import InputChecker
from gateway.batches.objects import FileObject, decode_file, encode, new_id
from gateway.batches.quota import StoredBytes
from policies.stores.base import StateStore

KIND = "file"


def not_found(message: str) -> GatewayError:
    """A 404 in the caller's envelope: a missing object and another tenant's answer alike."""
    return GatewayError(404, "not_found", message)


class Upload:
    """An uploaded file on its way to disk: written to a temporary file in the files directory as it
    arrives, each piece checked as a batch input (`InputChecker`), then renamed into place."""

    def __init__(self, directory: Path, max_lines: int) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # prompts and answers: owner only
        self.path = directory / f"upload-{os.urandom(8).hex()}.part"
        self._file = os.fdopen(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")
        self._checker = InputChecker(max_lines)

    def write(self, data: bytes) -> None:
        self._checker.feed(data)
        self._file.write(data)

    def finish(self) -> None:
        """Check the last line, and flush the file to disk (blocking: call it off the event loop)."""
        self._checker.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)


class Files:
    """The tenant-scoped file service."""

    def __init__(self, store: StateStore, directory: str, quota: StoredBytes) -> None:
        self._store = store
        self.directory = Path(directory)
        self.quota = quota

    def begin_upload(self, max_lines: int) -> Upload:
        """A new upload's temporary file (blocking: call it off the event loop)."""
        return Upload(self.directory, max_lines)

    async def store_upload(self, tenant: str, upload: Upload, filename: str, size: int, now: float) -> FileObject:
        """Move a finished upload into place and record it (its bytes are counted by the caller)."""
        file_id = new_id("file-")
        await asyncio.to_thread(os.replace, upload.path, self.path(file_id))
        obj = FileObject(id=file_id, bytes=size, created_at=int(now), filename=filename, purpose="batch")
        await self._store.put_record(KIND, file_id, tenant, now, encode(obj))
        return obj

    def path(self, file_id: str) -> Path:
        # ids are made here (random hex, or a job's fixed names); a record is looked up before any
        # path is built from a URL, and this refuses anything that could leave the directory
        if "/" in file_id or "\\" in file_id or file_id.startswith("."):
            raise not_found(f"no such file: {file_id[:64]!r}")
        return self.directory / file_id

    async def create(
        self, tenant: str, filename: str, purpose: str, data: bytes, now: float, file_id: str | None = None
    ) -> FileObject:
        """Store a file's body and record, its bytes counted and never refused (a job's results);
        `file_id` (a job's output) makes a rewrite idempotent, counted once."""
        previous = 0
        if file_id is not None and (found := await self._store.get_record(KIND, file_id)) is not None:
            previous = decode_file(found[1]).bytes  # a finalization run again: counted already
        file_id = file_id or new_id("file-")
        await asyncio.to_thread(self._write, file_id, data)
        obj = FileObject(id=file_id, bytes=len(data), created_at=int(now), filename=filename, purpose=purpose)
        await self._store.put_record(KIND, file_id, tenant, now, encode(obj))
        await self.quota.add(tenant, len(data) - previous, now)
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

    async def delete(self, tenant: str, file_id: str, now: float) -> None:
        obj = await self.get(tenant, file_id)
        if await self._store.delete_record(KIND, file_id):  # two deletes at once free it once
            await self.quota.add(tenant, -obj.bytes, now)
        await asyncio.to_thread(self.path(file_id).unlink, missing_ok=True)
