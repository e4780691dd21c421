"""The Batch API's parts of one gateway process, opened in the app's lifespan."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.batches.book import Book
from gateway.batches.config import BatchesConfig
from gateway.batches.files import Files
from gateway.batches.job import JobContext
from gateway.batches.quota import StoredBytes
from gateway.batches.runner import Runner
from gateway.core.service import GatewayCore
from policies.admission import Admission
from policies.stores.base import StateStore


@dataclass
class BatchService:
    """Files, batch records and the runner, for the HTTP routes and the lifespan."""

    config: BatchesConfig
    files: Files
    book: Book
    runner: Runner
    clock: Callable[[], float]

    @classmethod
    def open(
        cls,
        config: BatchesConfig,
        store: StateStore,
        admission: Admission,
        core: Callable[[], GatewayCore],
        clock: Callable[[], float],
    ) -> BatchService:
        files = Files(store, config.files_dir, StoredBytes(store, admission.instance, config.max_tenant_bytes))
        book = Book(store)
        ctx = JobContext(core, admission, book, files, config, clock, admission.instance)
        return cls(config, files, book, Runner(ctx, store), clock)
