"""`https://host/path/file[#sha256=HEX]` (and `http://`) through httpx, resumed with Range requests."""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

import httpx

from backends.sources.address import Address
from backends.sources.cache import digest
from backends.sources.errors import SourceError, SourceForbidden, SourceNotFound, Unreachable
from backends.sources.types import Listing, RemoteFile


def _raise_for(address: Address, response: httpx.Response) -> None:
    status = response.status_code
    if status < 400:
        return
    where = f"{address.text}: {response.request.url.host} answered {status}"
    if status in (404, 410):
        raise SourceNotFound(f"{where}: no such file")
    if status in (401, 403):
        raise SourceForbidden(
            f"{where}: the file needs credentials; fleetgate sends none to URL addresses (HF_TOKEN goes to "
            "hf:// only): give a presigned URL, or use s3:// with the AWS_* credentials"
        )
    raise SourceError(where)


def _unreachable(address: Address, exc: httpx.HTTPError) -> Unreachable:
    return Unreachable(f"{address.text}: cannot reach the server ({type(exc).__name__}: {exc})")


def ranged_get(
    client: httpx.Client, address: Address, url: str, headers: dict[str, str], start: int
) -> tuple[int, Iterator[bytes]]:
    """GET `url` from byte `start` on; (offset the body begins at, its chunks)."""
    if start:
        headers = {**headers, "Range": f"bytes={start}-"}
    try:
        response = client.send(client.build_request("GET", url, headers=headers), stream=True)
    except httpx.HTTPError as exc:
        raise _unreachable(address, exc) from None
    if response.status_code == 416:  # asked from the end: nothing is left to read
        response.close()
        return start, iter(())
    try:
        _raise_for(address, response)
    except SourceError:
        response.close()
        raise
    offset = start if response.status_code == 206 else 0

    def chunks() -> Iterator[bytes]:
        try:
            yield from response.iter_bytes()  # as it arrives: a cut leaves all it got
        except httpx.HTTPError as exc:
            raise _unreachable(address, exc) from None
        finally:
            response.close()

    return offset, chunks()


class WebFetcher:
    """One file at a URL; its revision is the `#sha256=` it promises, else its ETag."""

    def __init__(self, read_timeout_s: float = 60.0) -> None:
        self._client = httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0, read=read_timeout_s))

    def list(self, address: Address) -> Listing:
        url = address.location
        try:
            response = self._client.head(url)
            if response.status_code in (405, 501):  # no HEAD: the headers of a GET
                with self._client.stream("GET", url) as streamed:
                    response = streamed
        except httpx.HTTPError as exc:
            raise _unreachable(address, exc) from None
        _raise_for(address, response)
        length = response.headers.get("content-length")
        size = int(length) if length and "content-encoding" not in response.headers else None
        etag = response.headers.get("etag", "").removeprefix("W/").strip('"') or None
        version = address.sha256 or etag or response.headers.get("last-modified") or "unversioned"
        name = unquote(posixpath.basename(urlsplit(url).path)) or "model"
        file = RemoteFile(
            path=name, size=size, sha256=address.sha256, locator=url, identity=f"url:{url}@{version}"
        )
        return Listing(address=address.text, revision=address.sha256 or digest(version), files=(file,), target=name)

    def read(self, address: Address, file: RemoteFile, start: int) -> tuple[int, Iterator[bytes]]:
        return ranged_get(self._client, address, file.locator, {}, start)
