"""`hf://org/name[@revision][/path]` through huggingface_hub (HF_ENDPOINT, HF_TOKEN honoured)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx

from backends.sources.address import Address, companions
from backends.sources.errors import SourceError, SourceForbidden, SourceNotFound, Unreachable
from backends.sources.types import Listing, RemoteFile
from backends.sources.web import ranged_get

#: weight formats skipped when a repository also has safetensors at its top (the engine reads those)
_DUPLICATE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".ot")


def _endpoint() -> str:
    from huggingface_hub import constants

    # read at call time: the library reads HF_ENDPOINT once, when it is first imported
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def _headers() -> dict[str, str]:
    from huggingface_hub.utils import build_hf_headers

    return build_hf_headers(token=os.environ.get("HF_TOKEN") or None)


def _wanted(paths: list[str], inside: str | None) -> list[str]:
    """The files of the repository the address needs (see docs/model_sources.md)."""
    if inside is not None:
        if inside in paths:
            return [inside] + [p for p in companions(inside) if p in paths]
        folder = inside.rstrip("/") + "/"
        return [p for p in paths if p.startswith(folder)]
    top = [p for p in paths if "/" not in p]
    if any(p.endswith(".safetensors") for p in top):
        return [p for p in top if not p.endswith(_DUPLICATE_WEIGHTS)]
    return paths


def _translate(address: Address, exc: Exception, endpoint: str) -> SourceError:
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    text, repo = address.text, address.location
    token = "HF_TOKEN is set" if os.environ.get("HF_TOKEN") else "if it is private or gated, set HF_TOKEN"
    if isinstance(exc, GatedRepoError):
        return SourceForbidden(f"{text}: {repo} is gated: accept its terms on the Hub and set HF_TOKEN")
    if isinstance(exc, RevisionNotFoundError):
        return SourceNotFound(f"{text}: revision {address.ref} not found in {repo}")
    if isinstance(exc, RepositoryNotFoundError):
        return SourceNotFound(f"{text}: repository {repo} not found at {endpoint} ({token})")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            return SourceForbidden(f"{text}: {endpoint} refused access ({status}); set HF_TOKEN to a token that may read {repo}")
        return SourceError(f"{text}: {endpoint} answered {status}")
    first = str(exc).splitlines()[0] if str(exc) else ""
    return Unreachable(f"{text}: cannot reach {endpoint} ({type(exc).__name__}: {first}); check HF_ENDPOINT, or set storage.offline")


class HfFetcher:
    """Lists a repository at one commit with `HfApi.model_info`; files come from its resolve URLs."""

    def __init__(self, read_timeout_s: float = 60.0) -> None:
        self._client = httpx.Client(follow_redirects=True, timeout=httpx.Timeout(30.0, read=read_timeout_s))

    def list(self, address: Address) -> Listing:
        from huggingface_hub import HfApi, hf_hub_url

        endpoint = _endpoint()
        try:
            info = HfApi(endpoint=endpoint).model_info(
                address.location, revision=address.ref, files_metadata=True, token=os.environ.get("HF_TOKEN") or None
            )
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line naming what to do
            raise _translate(address, exc, endpoint) from None
        siblings = {s.rfilename: s for s in info.siblings or ()}
        paths = _wanted(sorted(siblings), address.path)
        if not paths:
            what = f"no file {address.path}" if address.path else "no files"
            raise SourceNotFound(f"{address.text}: {what} in {address.location} at {info.sha}")
        files = []
        for path in paths:
            s = siblings[path]
            sha256 = s.lfs.sha256 if s.lfs else None
            files.append(
                RemoteFile(
                    path=path,
                    size=s.lfs.size if s.lfs else s.size,
                    sha256=sha256,
                    git_sha1=None if s.lfs else s.blob_id,
                    locator=hf_hub_url(address.location, path, revision=info.sha, endpoint=endpoint),
                    identity=f"hf:{endpoint}/{address.location}:{sha256 or s.blob_id or info.sha + '/' + path}",
                )
            )
        target = address.path or ""
        if target and target not in siblings:  # a folder: the loader gets the folder
            target = target.rstrip("/")
        return Listing(address=address.text, revision=str(info.sha), files=tuple(files), target=target)

    def read(self, address: Address, file: RemoteFile, start: int) -> tuple[int, Iterator[bytes]]:
        return ranged_get(self._client, address, file.locator, _headers(), start)
