"""`gateway.observe.metrics.child`: the labelled children the request path reuses are asked of the metric once
and are the ones a scrape reads."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from gateway.observe import metrics


def _counter() -> tuple[Counter, CollectorRegistry, list[tuple[str, ...]]]:
    """A counter in a registry of its own whose `labels()` calls are recorded."""
    registry = CollectorRegistry()
    counter = Counter("fleetgate_test_child_total", "test", ["deployment", "tenant"], registry=registry)
    asked: list[tuple[str, ...]] = []
    plain = counter.labels

    def recorded(*labels: str) -> object:
        asked.append(labels)
        return plain(*labels)

    counter.labels = recorded  # type: ignore[method-assign]
    return counter, registry, asked


def test_a_child_is_asked_of_the_metric_once_and_counts_in_the_scrape() -> None:
    counter, registry, asked = _counter()
    first = metrics.child(counter, "mlp", "acme")
    metrics.child(counter, "mlp", "acme").inc(2)
    metrics.child(counter, "mlp", "acme").inc()
    other = metrics.child(counter, "mlp", "other")
    assert asked == [("mlp", "acme"), ("mlp", "other")]  # kept after the first call
    assert other is not first
    scraped = generate_latest(registry).decode()
    assert 'fleetgate_test_child_total{deployment="mlp",tenant="acme"} 3.0' in scraped


def test_a_metric_of_the_same_name_in_another_registry_gets_its_own_children() -> None:
    one, one_registry, _ = _counter()
    two, two_registry, _ = _counter()
    metrics.child(one, "mlp", "acme").inc()
    metrics.child(two, "mlp", "acme").inc(5)
    assert 'tenant="acme"} 1.0' in generate_latest(one_registry).decode()
    assert 'tenant="acme"} 5.0' in generate_latest(two_registry).decode()
