"""Live traffic for the console, read from the gateway's own /metrics text.

Each look at the traffic page (and each of its refreshes) takes a snapshot of the cumulative
counters; rates and latency percentiles are the difference between the newest snapshot and the
oldest one of the last `WINDOW_S` seconds. Reading the exposition text rather than the Python metric
objects means a gateway with `server.workers > 1` shows every worker's traffic, summed.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

#: rates are averaged over at most this many seconds of snapshots
WINDOW_S = 10.0
_KEEP = 64


@dataclass
class Snapshot:
    """Cumulative figures at one moment (counters only grow; gauges are as they were)."""

    at: float
    requests: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    errors: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float))
    #: model -> upper bound -> cumulative count (every protocol and deployment summed)
    buckets: dict[str, dict[float, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    #: (deployment, tenant) -> requests waiting now
    queued: dict[tuple[str, str], float] = field(default_factory=dict)
    #: deployment -> fraction of KV blocks in use
    kv_usage: dict[str, float] = field(default_factory=dict)


def parse(text: str, at: float) -> Snapshot:
    """The figures the console shows, out of a Prometheus exposition."""
    snap = Snapshot(at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "fleetgate_requests_total":
                key = (labels.get("model", ""), labels.get("tenant", ""))
                snap.requests[key] += sample.value
                if labels.get("status", "").isdigit() and int(labels["status"]) >= 400:
                    snap.errors[key] += sample.value
            elif sample.name == "fleetgate_request_duration_seconds_bucket":
                snap.buckets[labels.get("model", "")][float(labels["le"])] += sample.value
            elif sample.name == "fleetgate_queue_depth":
                snap.queued[(labels.get("deployment", ""), labels.get("tenant", ""))] = sample.value
            elif sample.name == "fleetgate_llm_kv_cache_usage_perc":
                snap.kv_usage[labels.get("deployment", "")] = sample.value
    return snap


def quantile(q: float, new: Mapping[float, float], old: Mapping[float, float]) -> float | None:
    """The q-quantile of the observations between two cumulative histograms (linear within a
    bucket, as Prometheus' histogram_quantile), or None when there were none."""
    bounds = sorted(new)
    counts = [new[b] - old.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank = q * counts[-1]
    lower, below = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower  # beyond the last finite bucket: its bound is the best known
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = bound, count
    return lower


class TrafficWindow:
    """The snapshots of the last seconds, and the figures between the oldest and the newest."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._snapshots: deque[Snapshot] = deque(maxlen=_KEEP)

    def observe(self, text: str) -> tuple[Snapshot, Snapshot]:
        """Add a snapshot of `text`; returns (baseline, newest) for the rates."""
        now = self._clock()
        newest = parse(text, now)
        self._snapshots.append(newest)
        while len(self._snapshots) > 1 and now - self._snapshots[0].at > WINDOW_S:
            self._snapshots.popleft()
        return self._snapshots[0], newest


def _rate(new: float, old: float, seconds: float) -> float | None:
    return None if seconds <= 0 else max(0.0, new - old) / seconds


def _summed(values: Mapping[tuple[str, str], float], index: int, name: str) -> float:
    return sum(v for k, v in values.items() if k[index] == name)


def figures(
    old: Snapshot,
    new: Snapshot,
    models: Mapping[str, Iterable[str]],
    tenants: Iterable[str],
) -> dict[str, object]:
    """Per model and per tenant: requests/s, errors/s, p50/p99 latency (models), queued now, the
    total served so far, and each LLM deployment's KV-cache use. `models` maps a model to its
    deployments (for its queue depth)."""
    seconds = new.at - old.at
    model_rows = []
    for model, deployments in models.items():
        deps = set(deployments)
        total = _summed(new.requests, 0, model)
        p50 = quantile(0.5, new.buckets.get(model, {}), old.buckets.get(model, {}))
        p99 = quantile(0.99, new.buckets.get(model, {}), old.buckets.get(model, {}))
        model_rows.append(
            {
                "model": model,
                "requests_per_s": _rate(total, _summed(old.requests, 0, model), seconds),
                "errors_per_s": _rate(_summed(new.errors, 0, model), _summed(old.errors, 0, model), seconds),
                "p50_ms": None if p50 is None else p50 * 1000,
                "p99_ms": None if p99 is None else p99 * 1000,
                "queued": sum(v for (dep, _), v in new.queued.items() if dep in deps),
                "total": total,
            }
        )
    tenant_rows = []
    for tenant in tenants:
        total = _summed(new.requests, 1, tenant)
        tenant_rows.append(
            {
                "tenant": tenant or "(no key)",
                "requests_per_s": _rate(total, _summed(old.requests, 1, tenant), seconds),
                "errors_per_s": _rate(
                    _summed(new.errors, 1, tenant), _summed(old.errors, 1, tenant), seconds
                ),
                "queued": sum(v for (_, t), v in new.queued.items() if t == tenant),
                "total": total,
            }
        )
    kv = [{"deployment": d, "usage": u} for d, u in sorted(new.kv_usage.items()) if d in _all(models)]
    return {"window_s": round(seconds, 1), "models": model_rows, "tenants": tenant_rows, "kv_cache": kv}


def _all(models: Mapping[str, Iterable[str]]) -> set[str]:
    return {d for deps in models.values() for d in deps}
