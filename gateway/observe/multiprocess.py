"""`/metrics` of `server.workers > 1`: every worker's series, summed (Prometheus multiprocess mode)."""

from __future__ import annotations

import os

#: prometheus_client reads this at import: every worker writes its metrics to files there
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

def multiprocess_metrics() -> bytes | None:
    """The exposition of every worker's metrics summed, or None outside multiprocess mode."""
    directory = os.environ.get(METRICS_DIR_ENV)
    if not directory:
        return None
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    from gateway.observe.vllm_metrics import VllmNames

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=directory)
    return generate_latest(registry) + generate_latest(VllmNames(registry))
