"""What a fetcher tells about an address, and the small interface every fetcher implements."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import msgspec

from backends.sources.address import Address


class RemoteFile(msgspec.Struct, frozen=True, kw_only=True):
    """One file of a resolved address."""

    #: its path inside the model's folder (for a single-file address: the file's name)
    path: str
    #: bytes, when the store says
    size: int | None = None
    #: what the content must hash to, when the store says (an LFS file, a `#sha256=` URL)
    sha256: str | None = None
    #: S3's ETag of a single-part upload is the content's MD5
    md5: str | None = None
    #: a Hugging Face file kept in git (not LFS) is named by its git blob id
    git_sha1: str | None = None
    #: where the fetcher reads it: a URL (hf, https) or an object key (s3)
    locator: str
    #: identifies these exact bytes at the store (URL or key plus version): a partial download is
    #: resumed only under the same identity
    identity: str


class Listing(msgspec.Struct, frozen=True, kw_only=True):
    """An address resolved at its store: the exact version and its files."""

    address: str
    #: the version served: a Hugging Face commit, an S3 listing's digest, a URL's sha256 or ETag
    revision: str
    files: tuple[RemoteFile, ...]
    #: the path inside the model's folder that the loader gets ("" : the folder itself)
    target: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


class Fetcher(Protocol):
    """A store's protocol, through its maintained client."""

    def list(self, address: Address) -> Listing:
        """Resolve the address at the store (metadata only, nothing is downloaded).

        Raises:
            SourceError: one line (not found, forbidden naming the variable, unreachable).
        """
        ...

    def read(self, address: Address, file: RemoteFile, start: int) -> tuple[int, Iterator[bytes]]:
        """The file's bytes from `start` on; returns the offset they really begin at (0 when the
        store ignored the range) and the chunks."""
        ...
