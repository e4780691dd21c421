"""`gateway.metrics.child`: the labelled children the request path reuses are the ones a scrape reads."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from gateway import metrics


def test_a_kept_child_is_the_metrics_own_and_counts_in_the_scrape() -> None:
    registry = CollectorRegistry()
    counter = Counter("fleetgate_test_child_total", "test", ["deployment", "tenant"], registry=registry)
    first = metrics.child(counter, "mlp", "acme")
    assert metrics.child(counter, "mlp", "acme") is first is counter.labels("mlp", "acme")
    assert metrics.child(counter, "mlp", "other") is not first
    first.inc(2)
    metrics.child(counter, "mlp", "acme").inc()
    scraped = generate_latest(registry).decode()
    assert 'fleetgate_test_child_total{deployment="mlp",tenant="acme"} 3.0' in scraped
