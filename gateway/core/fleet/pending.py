"""Deployments whose model addresses are not in the cache yet: fetched in the background while
the others serve, then built and loaded like any deployment (a failed fetch is retried with the
load's backoff). Until then the deployment is not ready and its readiness detail says why."""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import get_type_hints

import structlog

from backends.base import Capability, GenerateRequest, ModelMetadata, estimate_prompt_tokens
from backends.errors import BackendUnavailable
from backends.registry import ADAPTERS, EMBEDDING_BACKENDS
from backends.sources import ModelSources, SourceError, is_address
from backends.sources.progress import LineProgress
from backends.spec import DeploymentSpec
from gateway.config.sources import spec_models, with_local_paths

log = structlog.get_logger(__name__)

#: how often the readiness detail's byte count of a download is refreshed
_REPORT_EVERY_S = 0.5


def expected_capabilities(spec: DeploymentSpec) -> frozenset[Capability]:
    """What the deployment's backend will serve once built (a request meanwhile gets 503, not
    400): the capabilities its adapter's `create` returns a backend class with.

    Raises:
        ValueError: the adapter cannot be imported (its extra is not installed).
    """
    try:
        module = importlib.import_module(ADAPTERS[spec.backend])
    except ImportError as exc:
        raise ValueError(f"backend {spec.backend!r} cannot be imported ({exc}); is its extra installed?") from None
    kinds = set(get_type_hints(module.create)["return"].capabilities)
    if spec.embedding is not None and spec.backend in EMBEDDING_BACKENDS:
        kinds.add(Capability.EMBED)
    return frozenset(kinds)


class PendingBackend:
    """Stands in for the backend of a deployment whose model is being fetched; never ready."""

    counts_prompt_tokens = False
    capacity = None

    def __init__(self, name: str, spec: DeploymentSpec) -> None:
        self.name = name
        self.capabilities = expected_capabilities(spec)
        self.batch_observer: Callable[[int, int], None] | None = None

    @property
    def ready(self) -> bool:
        return False

    async def load(self) -> None:
        raise BackendUnavailable(f"deployment {self.name!r}: its model files are not fetched yet")

    async def warmup(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def metadata(self) -> ModelMetadata:
        raise BackendUnavailable(f"deployment {self.name!r} is not loaded: its model files are being fetched")

    async def count_prompt_tokens(self, request: GenerateRequest) -> int:
        return estimate_prompt_tokens(request)


class _Reporter(LineProgress):
    """Download progress as the deployment's readiness detail (`fetching ADDRESS FILE: 3.1 of 40.0
    MB (8%)`); stops the download when the gateway shuts down."""

    def __init__(self, show: Callable[[str], None], stop: threading.Event) -> None:
        super().__init__(show, every_s=_REPORT_EVERY_S)
        self._stop = stop

    def advance(self, n: int) -> None:
        if self._stop.is_set():
            raise SourceError("fetch cancelled: the gateway is shutting down")
        super().advance(n)


class PendingFetch:
    """The addresses of one deployment still to fetch, and the spec its backend is built from."""

    def __init__(self, spec: DeploymentSpec, sources: ModelSources) -> None:
        self.spec = spec
        self.sources = sources
        first = next(v for _, v in spec_models(spec) if is_address(v))
        #: the readiness detail until the first bytes arrive
        self.waiting = f"fetching {first}: its model files are not in the cache yet"
        self._stop = threading.Event()

    def cancel(self) -> None:
        """Stop a download under way (from the event loop's thread) at its next chunk."""
        self._stop.set()

    def run(self, show: Callable[[str], None]) -> DeploymentSpec:
        """Fetch every address (blocking: run it in a thread); the spec with local paths.

        Raises:
            SourceError: one line (unreachable, not found, forbidden, checksum, disk full).
        """
        reporter = _Reporter(show, self._stop)

        def fetch(text: str) -> Path:
            return self.sources.fetch(text, reporter)

        local = with_local_paths(self.spec, fetch)
        assert local is not None  # fetch returns a path or raises
        return local


def localize(spec: DeploymentSpec, sources: ModelSources) -> tuple[DeploymentSpec, PendingFetch | None]:
    """The spec to build the backend from now (addresses the cache holds replaced by their
    folders), or the spec as written and the fetch it waits for."""
    if not any(is_address(v) for _, v in spec_models(spec)):
        return spec, None
    local = with_local_paths(spec, sources.cached)
    if local is not None:
        for _, value in spec_models(spec):  # what is served: the exact revision of each address
            manifest = sources.cache.lookup(value) if is_address(value) else None
            if manifest is not None:
                log.info("model_from_cache", address=value, revision=manifest.revision)
        return local, None
    return spec, PendingFetch(spec, sources)
