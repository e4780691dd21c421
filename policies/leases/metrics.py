"""Prometheus metrics of admission's state path: leases working, and store writes waiting for retry.

Declared here, not in gateway/observe/metrics.py: policies never import the gateway (the rooms of
docs/architecture.md), and these are counted where admission decides. They sit in the default
registry as the gateway's own do, so /metrics serves them; with `server.workers > 1` each worker
writes its values to the multiprocess directory and /metrics sums them (counters summed, the
gauge summed over live workers). Names and meaning: docs/state.md, "Watching leases".
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

LOCAL_ADMITS = Counter(
    "fleetgate_lease_local_admits_total",
    "Requests admitted from the slices and slots this process holds, with no store call.",
)
TOPUPS = Counter(
    "fleetgate_lease_topups_total",
    "Top-ups taken: store acquires of slices for a request the slices held did not cover.",
)
PARTITION_ADMITS = Counter(
    "fleetgate_lease_partition_admits_total",
    "Requests admitted beyond the slices while the state store was cut off (state.partition's bound).",
)
SETTLES_PENDING = Gauge(
    "fleetgate_state_settles_pending",
    "Store writes (settles: batches, slices and slots given back, deferred reconciles) waiting for "
    "the store to answer, by admission strategy (leases, per_request).",
    ["strategy"],
    multiprocess_mode="livesum",
)
#: the children written to, resolved once (`labels()` takes the metric's lock each time)
LEASE_SETTLES_PENDING = SETTLES_PENDING.labels("leases")
REQUEST_SETTLES_PENDING = SETTLES_PENDING.labels("per_request")
