"""One file into the cache: resumed where a killed download stopped, verified, then renamed in."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Protocol

from backends.sources.address import Address
from backends.sources.cache import CHUNK, Cache, digest, hash_file, no_space
from backends.sources.errors import ChecksumMismatch
from backends.sources.types import Fetcher, RemoteFile


class Progress(Protocol):
    """Where a download reports its bytes (a terminal bar, periodic log lines, nothing)."""

    def begin(self, label: str, total: int | None, done: int) -> None: ...

    def advance(self, n: int) -> None: ...

    def end(self) -> None: ...


class Quiet:
    """No progress reports."""

    def begin(self, label: str, total: int | None, done: int) -> None:
        pass

    def advance(self, n: int) -> None:
        pass

    def end(self) -> None:
        pass


class _Hashes:
    """Every digest the store may promise, fed once with the bytes."""

    def __init__(self, file: RemoteFile) -> None:
        self.sha256 = hashlib.sha256()
        self.md5 = hashlib.md5(usedforsecurity=False) if file.md5 else None
        self.git = None
        if file.git_sha1 and file.size is not None:  # git names a blob by sha1("blob <size>\0" + content)
            self.git = hashlib.sha1(f"blob {file.size}\0".encode(), usedforsecurity=False)

    def update(self, chunk: bytes) -> None:
        self.sha256.update(chunk)
        if self.md5 is not None:
            self.md5.update(chunk)
        if self.git is not None:
            self.git.update(chunk)

    def problem(self, file: RemoteFile, size: int) -> str | None:
        """Why the bytes are not the file the store described, or None."""
        if file.size is not None and size != file.size:
            return f"{size} bytes arrived, {file.size} expected"
        for name, want, got in (
            ("sha256", file.sha256, self.sha256.hexdigest()),
            ("md5 (ETag)", file.md5, self.md5.hexdigest() if self.md5 else None),
            ("git blob id", file.git_sha1, self.git.hexdigest() if self.git else None),
        ):
            if want is not None and got is not None and want.lower() != got:
                return f"{name} is {got}, {want} expected"
        return None


def _hash_existing(part: Path, hashes: _Hashes) -> int:
    size = 0
    with part.open("rb") as f:
        while chunk := f.read(CHUNK):
            hashes.update(chunk)
            size += len(chunk)
    return size


def _write_from(
    cache: Cache, fetcher: Fetcher, address: Address, file: RemoteFile, part: Path, progress: Progress
) -> tuple[int, _Hashes]:
    """Append the rest of the file to `part` (or start over when the store ignores the range);
    the size written in all and the digests of the whole file."""
    hashes = _Hashes(file)
    if part.exists() and file.size is not None and part.stat().st_size > file.size:
        part.unlink()  # longer than the file: not a prefix of it
    start = _hash_existing(part, hashes) if part.exists() else 0
    progress.begin(f"{address.text} {file.path}", file.size, start)
    try:
        if file.size is not None and start == file.size:
            return start, hashes
        offset, chunks = fetcher.read(address, file, start)
        if offset != start:  # the store sent the whole file
            hashes, start = _Hashes(file), 0
        size = start
        with part.open("ab" if start else "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                hashes.update(chunk)
                size += len(chunk)
                progress.advance(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        return size, hashes
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise no_space(exc, cache.root, file.size) from None
        raise
    finally:
        progress.end()


def fetch_file(cache: Cache, fetcher: Fetcher, address: Address, file: RemoteFile, progress: Progress) -> str:
    """Bring one file into the cache's blobs (once, whoever asks at the same time); its sha256.

    Raises:
        ChecksumMismatch: the bytes are not what the store or the address promised (after one try
            from scratch when a resumed part was to blame).
    """
    with cache.lock(f"file-{digest(file.identity)}"):
        # in the cache already (this address before, another address of the same bytes, or another
        # process meanwhile): re-read before it goes into a new snapshot; a damaged copy is dropped
        if (known := cache.known(file)) is not None:
            if hash_file(cache.blob(known)) == known:
                return known
            cache.blob(known).unlink(missing_ok=True)
        part = cache.partial(file.identity)
        for attempt in range(2):
            resumed = part.exists() and part.stat().st_size > 0
            size, hashes = _write_from(cache, fetcher, address, file, part, progress)
            problem = hashes.problem(file, size)
            if problem is None:
                sha256 = hashes.sha256.hexdigest()
                cache.commit_blob(part, sha256, file.identity)
                return sha256
            part.unlink(missing_ok=True)
            if not (resumed and attempt == 0):
                break
        raise ChecksumMismatch(f"{address.text}: checksum mismatch on {file.path}: {problem}; nothing was kept")
