"""The model cache: content-addressed blobs, resumable partial files, and complete snapshots.

Layout under the cache folder (one volume may be shared by every worker and replica):

    blobs/<sha256>              verified content, read-only, named by its hash (shared by addresses)
    partial/<id>.part           a download under way or interrupted (resumed by the next try)
    locks/<name>.lock           advisory file locks (flock): one downloader per file and per snapshot
    snapshots/<snapshot>/...    a model's folder: hard links to blobs, renamed into place complete
    manifests/<snapshot>.json   what a snapshot holds (address, revision, files and their sha256),
                                written last: a snapshot without its manifest is never served
    refs/<address>.json         the snapshot an address resolved to last (offline mode reads it)
    known/<identity>            the blob a file of a store (URL or key, and version) was verified as

A process killed at any point leaves a partial file (resumed) or a temporary folder (replaced),
never a snapshot that looks complete.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from backends.sources.errors import DiskFull
from backends.sources.types import Listing, RemoteFile

CHUNK = 1 << 20


class FileRecord(msgspec.Struct, frozen=True):
    sha256: str
    size: int


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    """A complete snapshot: the address it was fetched for and the verified files it holds."""

    address: str
    revision: str
    snapshot: str
    target: str
    files: dict[str, FileRecord]
    fetched_at: float

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files.values())


def digest(text: str) -> str:
    """A short stable name for a text (an address, a download identity)."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def no_space(exc: OSError, root: Path, needed: int | None = None) -> DiskFull:
    free = shutil.disk_usage(root).free if root.exists() else 0
    need = f" ({needed / 1e6:.1f} MB needed)" if needed else ""
    return DiskFull(f"disk full: no room in the model cache {root}{need}, {free / 1e6:.1f} MB free ({exc.strerror})")


class Cache:
    """One cache folder. Every method is safe with other processes using the same folder."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _dir(self, name: str) -> Path:
        path = self.root / name
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise no_space(exc, self.root) from None
            raise
        return path

    @contextlib.contextmanager
    def lock(self, name: str) -> Iterator[None]:
        """An exclusive lock across processes (flock; released by the kernel if the holder dies)."""
        with (self._dir("locks") / f"{name}.lock").open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    # --- blobs ---------------------------------------------------------------------------------

    def blob(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256

    def partial(self, identity: str) -> Path:
        return self._dir("partial") / f"{digest(identity)}.part"

    def commit_blob(self, part: Path, sha256: str, identity: str) -> Path:
        """Move a verified download into place (atomic rename on one volume), and remember which
        blob these bytes of the store are (another address naming them needs no download)."""
        target = self._dir("blobs") / sha256
        os.chmod(part, 0o444)
        os.replace(part, target)
        self._write(self._dir("known") / digest(identity), sha256.encode())
        return target

    def known(self, file: RemoteFile) -> str | None:
        """The blob holding a file of the store, when the cache has it (by hash or by identity)."""
        sha256 = file.sha256
        if sha256 is None:
            try:
                sha256 = (self.root / "known" / digest(file.identity)).read_text().strip()
            except FileNotFoundError:
                return None
        return sha256 if self.blob(sha256).exists() else None

    # --- snapshots -----------------------------------------------------------------------------

    @staticmethod
    def snapshot_id(key: str, revision: str) -> str:
        """The snapshot of an address's key (see `Address.key`) at one revision."""
        return digest(f"{key}\n{revision}")

    def snapshot_path(self, manifest: Manifest) -> Path:
        folder = self.root / "snapshots" / manifest.snapshot
        return folder / manifest.target if manifest.target else folder

    def manifest(self, snapshot: str) -> Manifest | None:
        try:
            return msgspec.json.decode((self.root / "manifests" / f"{snapshot}.json").read_bytes(), type=Manifest)
        except (FileNotFoundError, msgspec.DecodeError):
            return None

    def lookup(self, address: str) -> Manifest | None:
        """The snapshot `address` resolved to last, from the cache alone (offline)."""
        try:
            snapshot = (self.root / "refs" / f"{digest(address)}.json").read_text().strip()
        except FileNotFoundError:
            return None
        return self.manifest(snapshot)

    def set_ref(self, manifest: Manifest) -> None:
        self._write(self._dir("refs") / f"{digest(manifest.address)}.json", manifest.snapshot.encode())

    def damaged(self, manifest: Manifest, *, full: bool) -> list[str]:
        """Files of a snapshot that are missing, of the wrong size or (full) the wrong content."""
        bad = []
        folder = self.root / "snapshots" / manifest.snapshot
        for path, record in manifest.files.items():
            file = folder / path
            try:
                if file.stat().st_size != record.size or (full and hash_file(file) != record.sha256):
                    bad.append(path)
            except FileNotFoundError:
                bad.append(path)
        return bad

    def drop(self, manifest: Manifest, damaged: list[str]) -> None:
        """Forget a damaged snapshot and its damaged blobs, so the next fetch writes them again."""
        (self.root / "manifests" / f"{manifest.snapshot}.json").unlink(missing_ok=True)
        shutil.rmtree(self.root / "snapshots" / manifest.snapshot, ignore_errors=True)
        for path in damaged:
            self.blob(manifest.files[path].sha256).unlink(missing_ok=True)

    def install(self, listing: Listing, blobs: dict[str, str], snapshot: str) -> Manifest:
        """Make the snapshot of `listing` from its verified blobs: links in a temporary folder,
        renamed into place, then the manifest (the mark of a complete snapshot), then the ref."""
        final = self._dir("snapshots") / snapshot
        temporary = final.with_name(f".{snapshot}.{os.getpid()}.tmp")
        shutil.rmtree(temporary, ignore_errors=True)
        files = {}
        try:
            for path, sha256 in blobs.items():
                link = temporary / path
                link.parent.mkdir(parents=True, exist_ok=True)
                try:
                    os.link(self.blob(sha256), link)
                except OSError:  # a volume without hard links: a copy
                    shutil.copyfile(self.blob(sha256), link)
                files[path] = FileRecord(sha256, link.stat().st_size)
            shutil.rmtree(final, ignore_errors=True)  # a folder left by a process killed before its manifest
            os.rename(temporary, final)
        except OSError as exc:
            shutil.rmtree(temporary, ignore_errors=True)
            if exc.errno == errno.ENOSPC:
                raise no_space(exc, self.root) from None
            raise
        manifest = Manifest(
            address=listing.address,
            revision=listing.revision,
            snapshot=snapshot,
            target=listing.target,
            files=files,
            fetched_at=time.time(),
        )
        self._write(self._dir("manifests") / f"{snapshot}.json", msgspec.json.encode(manifest))
        self.set_ref(manifest)
        return manifest

    def _write(self, path: Path, data: bytes) -> None:
        """Write a small file atomically (a reader sees the old or the new content, never half)."""
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            temporary.write_bytes(data)
            os.replace(temporary, path)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise no_space(exc, self.root) from None
            raise

    # --- listing and removal (`fleetgate cache ls|rm`) ----------------------------------------

    def entries(self) -> list[Manifest]:
        folder = self.root / "manifests"
        found = [self.manifest(p.stem) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []
        return sorted((m for m in found if m is not None), key=lambda m: (m.address, m.fetched_at))

    def remove(self, manifests: list[Manifest]) -> int:
        """Remove snapshots and the blobs no other snapshot uses; returns the bytes freed."""
        gone = {m.snapshot for m in manifests}
        kept = {f.sha256 for m in self.entries() if m.snapshot not in gone for f in m.files.values()}
        freed = 0
        for manifest in manifests:
            with self.lock(f"snap-{manifest.snapshot}"):
                (self.root / "manifests" / f"{manifest.snapshot}.json").unlink(missing_ok=True)
                shutil.rmtree(self.root / "snapshots" / manifest.snapshot, ignore_errors=True)
                ref = self.root / "refs" / f"{digest(manifest.address)}.json"
                if ref.exists() and ref.read_text().strip() == manifest.snapshot:
                    ref.unlink(missing_ok=True)
            for record in manifest.files.values():
                blob = self.blob(record.sha256)
                if record.sha256 not in kept and blob.exists():
                    freed += blob.stat().st_size
                    blob.unlink(missing_ok=True)
                    kept.add(record.sha256)  # counted once when two files share it
        return freed
