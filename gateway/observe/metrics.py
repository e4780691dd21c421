"""Prometheus metrics of the gateway (default registry, created once per process).

Labels never carry secrets: tenants are config names and keys appear only by their public id,
which is not used as a label at all to keep cardinality bounded.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

#: the labelled children the request path asks for, by (metric, label values); keyed by the metric
#: object itself, not its name: a metric of the same name in another registry (tests) is another
_children: dict[tuple[Any, tuple[str, ...]], Any] = {}


def child(metric: Any, *labels: str) -> Any:
    """`metric.labels(*labels)`, kept for the next call: `labels()` validates its arguments and
    takes the metric's lock each time, and a request's path asks for the same few children (a
    deployment, a tenant) over and over. Label values are config names, so the cache is bounded;
    metrics whose children are cleared (`ROUTE_WEIGHT`) must not be read through it."""
    key = (metric, labels)
    found = _children.get(key)
    if found is None:
        found = _children[key] = metric.labels(*labels)
    return found


_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)

REQUESTS = Counter(
    "fleetgate_requests_total",
    "Requests answered, by protocol, model, deployment, tenant and HTTP status.",
    ["protocol", "model", "deployment", "tenant", "status"],
)
REQUEST_LATENCY = Histogram(
    "fleetgate_request_duration_seconds",
    "Time from request received to response sent (streams: to the last event).",
    ["protocol", "model", "deployment"],
    buckets=_LATENCY_BUCKETS,
)
BATCH_SIZE = Histogram(
    "fleetgate_batch_size_rows",
    "Rows per batch run by the dynamic batcher.",
    ["deployment"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
BATCH_REQUESTS = Histogram(
    "fleetgate_batch_requests",
    "Requests merged into one batch by the dynamic batcher.",
    ["deployment"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)
#: with `server.workers > 1` a gauge is one series per live worker (pid label); a dead worker's series
#: go when the supervisor marks it dead, so a crashed worker's last queue depth cannot feed an
#: autoscaler forever
LIVE_WORKERS_ONLY = "liveall"

QUEUE_DEPTH = Gauge(
    "fleetgate_queue_depth",
    "Requests waiting in a deployment's fair queue, by tenant.",
    ["deployment", "tenant"],
    multiprocess_mode=LIVE_WORKERS_ONLY,
)
QUEUE_BACKGROUND = Gauge(
    "fleetgate_queue_background",
    "Batch-job requests in a deployment's background class, by state (waiting, in_flight).",
    ["deployment", "state"],
)
QUEUE_TIME = Histogram(
    "fleetgate_queue_time_seconds",
    "Time a request waited in the fair queue before reaching the backend.",
    ["deployment", "tenant"],
    buckets=_LATENCY_BUCKETS,
)
BACKEND_READY = Gauge(
    "fleetgate_backend_ready",
    "1 when the deployment is loaded and warmed up, else 0.",
    ["deployment", "backend", "device", "hardware"],
    multiprocess_mode=LIVE_WORKERS_ONLY,
)
REJECTIONS = Counter(
    "fleetgate_rejections_total",
    "Requests refused by a policy, by tenant and reason (rate_limit_exceeded, quota_exceeded, queue_full...).",
    ["tenant", "reason"],
)
FALLBACKS = Counter(
    "fleetgate_fallbacks_total",
    "Requests retried on a fallback deployment after the first choice failed or was unhealthy.",
    ["model", "from_deployment", "to_deployment"],
)
TIME_TO_FIRST_TOKEN = Histogram(
    "fleetgate_time_to_first_token_seconds",
    "Time from request received to the first generated text.",
    ["model", "deployment"],
    buckets=_LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "fleetgate_inter_token_latency_seconds",
    "Time between consecutive stream events of one generation.",
    ["model", "deployment"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
TOKENS = Counter(
    "fleetgate_tokens_total",
    "Tokens served, by tenant, model and kind (prompt or completion).",
    ["tenant", "model", "kind"],
)
CIRCUIT_OPENED = Counter(
    "fleetgate_circuit_opened_total",
    "Times a deployment's circuit breaker opened (the router skips it until a probe succeeds).",
    ["deployment"],
)

# --- routing: canaries, least-wait pools ----------------------------------------------------------

CANARY_ROLLBACKS = Counter(
    "fleetgate_canary_rollbacks_total",
    "Canary routes rolled back automatically (weight set to 0), by reason (error_rate or latency).",
    ["model", "deployment", "reason"],
)
ROUTE_WEIGHT = Gauge(
    "fleetgate_route_effective_weight",
    "Weight the router applies to a route now (0 while its canary is rolled back).",
    ["model", "deployment"],
    multiprocess_mode=LIVE_WORKERS_ONLY,
)
SERVICE_TIME = Gauge(
    "fleetgate_service_time_seconds",
    "Recent service time of a deployment (EWMA of backend time per request, queue wait excluded).",
    ["deployment", "device", "hardware"],
    multiprocess_mode=LIVE_WORKERS_ONLY,
)
EXPECTED_WAIT = Gauge(
    "fleetgate_expected_wait_seconds",
    "Expected time until a new request would be done: (queued + in flight + 1) x service time / slots.",
    ["deployment", "device", "hardware"],
    multiprocess_mode=LIVE_WORKERS_ONLY,
)

# --- shadows ------------------------------------------------------------------------------------

_DIFF_BUCKETS = (1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 10, 100)

SHADOW_REQUESTS = Counter(
    "fleetgate_shadow_requests_total",
    "Requests mirrored to a shadow, by outcome (ok, error, dropped: too many shadows in flight).",
    ["model", "primary", "shadow", "outcome"],
)
SHADOW_COMPARED = Counter(
    "fleetgate_shadow_compared_total",
    "Shadow answers compared with the primary's (tensor pairs with matching shapes, or text pairs).",
    ["model", "primary", "shadow"],
)
SHADOW_SHAPE_MISMATCH = Counter(
    "fleetgate_shadow_shape_mismatch_total",
    "Shadow tensor answers whose output names or shapes differ from the primary's (not in the diffs).",
    ["model", "primary", "shadow"],
)
SHADOW_MAX_ABS_DIFF = Histogram(
    "fleetgate_shadow_max_abs_diff",
    "Per compared request: max |shadow - primary| over every numeric output element.",
    ["model", "primary", "shadow"],
    buckets=_DIFF_BUCKETS,
)
SHADOW_MAX_REL_DIFF = Histogram(
    "fleetgate_shadow_max_rel_diff",
    "Per compared request: max |shadow - primary| / max(|primary|, 1e-6) over numeric outputs.",
    ["model", "primary", "shadow"],
    buckets=_DIFF_BUCKETS,
)
SHADOW_EXACT_MATCH = Counter(
    "fleetgate_shadow_exact_match_total",
    "Text shadow answers identical to the primary's (exact-match rate = this / compared).",
    ["model", "primary", "shadow"],
)
SHADOW_TOKEN_AGREEMENT = Histogram(
    "fleetgate_shadow_token_agreement",
    "Per compared text pair: fraction of positions equal (token ids when both sides have them, else words).",
    ["model", "primary", "shadow", "unit"],
    buckets=(0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
)

# --- model graphs -------------------------------------------------------------------------------

GRAPH_STEPS = Counter(
    "fleetgate_graph_steps_total",
    "Steps of graph requests, by graph, step and outcome (ran, skipped: its condition did not hold, failed).",
    ["graph", "step", "outcome"],
)
GRAPH_STEP_ROWS = Counter(
    "fleetgate_graph_step_rows_total",
    "Request rows per graph step and outcome: a per-row cascade runs a step on some rows and skips the rest.",
    ["graph", "step", "outcome"],
)

# --- money (docs/pricing.md) -----------------------------------------------------------------------

SPEND = Counter(
    "fleetgate_spend_usd_total",
    "USD charged for settled requests at their model's or deployment's price, by tenant and model.",
    ["tenant", "model"],
)
BUDGET_USED = Gauge(
    "fleetgate_budget_used_ratio",
    "Share of a tenant's budget spent or reserved (1: spent), as last seen by an admission here.",
    ["tenant", "budget"],
    multiprocess_mode="max",
)
BUDGET_ALERTS = Counter(
    "fleetgate_budget_alerts_total",
    "Budget thresholds passed (each once per budget period across replicas), by tenant, whose budget "
    "(tenant or key: key ids are not labels) and threshold.",
    ["tenant", "owner", "budget", "threshold"],
)
