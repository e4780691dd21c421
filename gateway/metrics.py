"""Prometheus metrics of the gateway (default registry, created once per process).

Labels never carry secrets: tenants are config names and keys appear only by their public id,
which is not used as a label at all to keep cardinality bounded.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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
QUEUE_DEPTH = Gauge(
    "fleetgate_queue_depth",
    "Requests waiting in a deployment's fair queue, by tenant.",
    ["deployment", "tenant"],
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
