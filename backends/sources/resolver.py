"""The one entry the config, the loaders and the CLI use: an address in, a local path out."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import structlog

from backends.sources.address import Address, is_address, parse_address
from backends.sources.cache import Cache, Manifest
from backends.sources.download import Progress, Quiet, fetch_file
from backends.sources.errors import DiskFull, NotCached, SourceError
from backends.sources.spec import StorageSpec
from backends.sources.types import Fetcher, Listing


def _log() -> structlog.typing.FilteringBoundLogger:
    """The logger as configured now: the resolver runs in `fleetgate pull` and in servers of one
    process (tests), and a logger cached at its first use would keep a stream closed since."""
    return structlog.get_logger(__name__)  # type: ignore[no-any-return]

_TRUE = ("1", "on", "yes", "true")
_HEX40 = frozenset("0123456789abcdef")


def _pinned(address: Address) -> bool:
    """Whether the address names one exact content (a commit, a sha256): a cached copy needs no lookup."""
    if address.scheme == "hf":
        return address.ref is not None and len(address.ref) == 40 and set(address.ref) <= _HEX40
    return address.sha256 is not None


def _default_fetcher(scheme: str, read_timeout_s: float) -> Fetcher:
    if scheme == "hf":
        from backends.sources.hf import HfFetcher

        return HfFetcher(read_timeout_s)
    if scheme == "s3":
        from backends.sources.s3 import S3Fetcher

        return S3Fetcher(read_timeout_s)
    from backends.sources.web import WebFetcher

    return WebFetcher(read_timeout_s)


class ModelSources:
    """Resolves model addresses into folders of the cache (`storage:` of the config).

    Args:
        spec: the cache folder, offline mode and how cached copies are checked.
        fetchers: scheme -> fetcher; default: huggingface_hub, boto3 and httpx, made when first used.
    """

    def __init__(self, spec: StorageSpec, fetchers: Mapping[str, Fetcher] | None = None) -> None:
        self.spec = spec
        self.cache = Cache(spec.root)
        self._fetchers: dict[str, Fetcher] = dict(fetchers or {})

    def _fetcher(self, scheme: str) -> Fetcher:
        if scheme not in self._fetchers:
            try:
                self._fetchers[scheme] = _default_fetcher(scheme, self.spec.read_timeout_s)
            except ImportError as exc:
                raise SourceError(
                    f"{scheme}:// addresses need {exc.name or exc}: install them with pip install 'fleetgate[sources]'"
                ) from None
        return self._fetchers[scheme]

    def offline(self, address: Address) -> bool:
        """Offline mode: `storage.offline`, or `HF_HUB_OFFLINE` for a Hugging Face address."""
        hub_offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE
        return self.spec.offline or (address.scheme == "hf" and hub_offline)

    def cached(self, text: str) -> Path | None:
        """The local path of an address the cache holds complete and intact, with no network (a
        local path is returned as it is); None when it must be fetched."""
        if not is_address(text):
            return Path(text)
        manifest = self.cache.lookup(text)
        if manifest is None or self.cache.damaged(manifest, full=self.spec.verify == "sha256"):
            return None
        return self.cache.snapshot_path(manifest)

    def check(self, text: str) -> Listing | Manifest:
        """Resolve an address without downloading it: its listing at the store (and room for it on
        the cache's volume), or in offline mode the cached snapshot.

        Raises:
            SourceError: one line (malformed, not found, forbidden naming the variable, unreachable,
                not cached while offline, no room on the cache's volume).
        """
        address = parse_address(text)
        if self.offline(address):
            return self._offline(address)
        listing = self._fetcher(address.scheme).list(address)
        self._check_room(listing)
        return listing

    def fetch(self, text: str, progress: Progress | None = None) -> Path:
        """The local path of an address, downloading what the cache lacks (once, whoever else asks).

        Raises:
            SourceError: as `check`, and a checksum mismatch.
        """
        if not is_address(text):
            return Path(text)
        address = parse_address(text)
        if self.offline(address):
            return self.cache.snapshot_path(self._offline(address))
        if _pinned(address) and (path := self.cached(text)) is not None:
            return path
        fetcher = self._fetcher(address.scheme)
        listing = fetcher.list(address)
        snapshot = self.cache.snapshot_id(address.key, listing.revision)
        with self.cache.lock(f"snap-{snapshot}"):
            manifest = self.cache.manifest(snapshot)
            if manifest is not None:
                damaged = self.cache.damaged(manifest, full=self.spec.verify == "sha256")
                if not damaged:
                    self.cache.set_ref(manifest)
                    return self.cache.snapshot_path(manifest)
                _log().warning("model_cache_damaged", address=text, files=damaged[:5], action="fetching again")
                self.cache.drop(manifest, damaged)
            self._check_room(listing)
            quiet = progress or Quiet()
            blobs = {f.path: fetch_file(self.cache, fetcher, address, f, quiet) for f in listing.files}
            manifest = self.cache.install(listing, blobs, snapshot)
        _log().info("model_fetched", address=text, revision=listing.revision, files=len(blobs), bytes=manifest.size)
        return self.cache.snapshot_path(manifest)

    def _offline(self, address: Address) -> Manifest:
        manifest = self.cache.lookup(address.text)
        where = f"the model cache {self.cache.root}"
        if manifest is None:
            raise NotCached(
                f"{address.text} is not in {where} and offline mode is on (storage.offline or HF_HUB_OFFLINE): "
                "run `fleetgate pull --config CFG` where the store can be reached"
            )
        damaged = self.cache.damaged(manifest, full=self.spec.verify == "sha256")
        if damaged:
            raise NotCached(
                f"{address.text}: {damaged[0]} in {where} is damaged and offline mode is on: "
                "run `fleetgate pull --config CFG` where the store can be reached"
            )
        return manifest

    def _check_room(self, listing: Listing) -> None:
        """Refuse before the first byte when the files the cache lacks cannot fit on its volume."""
        needed = sum(f.size or 0 for f in listing.files if self.cache.known(f) is None)
        root = self.cache.root
        root.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(root).free
        if needed > free:
            raise DiskFull(
                f"{listing.address}: disk full: it needs {needed / 1e6:.1f} MB and the model cache {root} "
                f"has {free / 1e6:.1f} MB free (storage.cache_dir)"
            )
