"""Prometheus metrics of the LLM engine (default registry, created once per process).

Names follow vLLM's (`vllm:<name>` becomes `fleetgate_llm_<name>`), labelled by `deployment`:

| fleetgate name | vLLM name |
| --- | --- |
| fleetgate_llm_num_requests_running | vllm:num_requests_running |
| fleetgate_llm_num_requests_waiting | vllm:num_requests_waiting |
| fleetgate_llm_kv_cache_usage_perc | vllm:kv_cache_usage_perc (fraction 0..1) |
| fleetgate_llm_kv_cache_waste_perc | (fleetgate) allocated-but-unused KV slots / allocated, last step |
| fleetgate_llm_prefix_cache_queries_total | vllm:prefix_cache_queries (tokens) |
| fleetgate_llm_prefix_cache_hits_total | vllm:prefix_cache_hits (tokens) |
| fleetgate_llm_num_preemptions_total | vllm:num_preemptions |
| fleetgate_llm_prompt_tokens_total | vllm:prompt_tokens |
| fleetgate_llm_generation_tokens_total | vllm:generation_tokens |
| fleetgate_llm_time_to_first_token_seconds | vllm:time_to_first_token_seconds |
| fleetgate_llm_inter_token_latency_seconds | vllm:inter_token_latency_seconds |
| fleetgate_llm_e2e_request_latency_seconds | vllm:e2e_request_latency_seconds |
| fleetgate_llm_iteration_tokens_total | vllm:iteration_tokens_total (histogram of tokens per step) |
| fleetgate_llm_request_success_total | vllm:request_success (label finished_reason) |
| fleetgate_llm_request_queue_time_seconds | vllm:request_queue_time_seconds (arrival to first scheduled) |
| fleetgate_llm_request_prefill_time_seconds | vllm:request_prefill_time_seconds (first scheduled to first token) |
| fleetgate_llm_request_decode_time_seconds | vllm:request_decode_time_seconds (first token to the end) |
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_L = ("deployment",)
#: one series per live worker with `server.workers > 1` (see gateway/observe/metrics.py's LIVE_WORKERS_ONLY)
_LIVE = "liveall"
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)

NUM_RUNNING = Gauge(
    "fleetgate_llm_num_requests_running", "Sequences in the running batch.", _L, multiprocess_mode=_LIVE
)
NUM_WAITING = Gauge(
    "fleetgate_llm_num_requests_waiting", "Sequences waiting for admission.", _L, multiprocess_mode=_LIVE
)
KV_USAGE = Gauge(
    "fleetgate_llm_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", _L, multiprocess_mode=_LIVE
)
KV_WASTE = Gauge(
    "fleetgate_llm_kv_cache_waste_perc",
    "Allocated but unused KV slots / allocated (0..1).",
    _L,
    multiprocess_mode=_LIVE,
)
PREFIX_QUERIES = Counter(
    "fleetgate_llm_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", _L
)
PREFIX_HITS = Counter("fleetgate_llm_prefix_cache_hits", "Prompt tokens found in the prefix cache.", _L)
PREEMPTIONS = Counter("fleetgate_llm_num_preemptions", "Sequences preempted (by recompute).", _L)
PROMPT_TOKENS = Counter("fleetgate_llm_prompt_tokens", "Prompt tokens of admitted requests.", _L)
GENERATION_TOKENS = Counter("fleetgate_llm_generation_tokens", "Generated tokens.", _L)
TTFT = Histogram("fleetgate_llm_time_to_first_token_seconds", "Time to first token.", _L, buckets=_LATENCY)
ITL = Histogram("fleetgate_llm_inter_token_latency_seconds", "Time between two tokens.", _L, buckets=_LATENCY)
E2E = Histogram(
    "fleetgate_llm_e2e_request_latency_seconds", "Request latency, arrival to end.", _L, buckets=_LATENCY
)
ITERATION_TOKENS = Histogram(
    "fleetgate_llm_iteration_tokens_total",
    "Tokens computed per engine step.",
    _L,
    buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192),
)
REQUEST_SUCCESS = Counter(
    "fleetgate_llm_request_success", "Finished requests by finish reason.", ("deployment", "finished_reason")
)
QUEUE_TIME = Histogram(
    "fleetgate_llm_request_queue_time_seconds", "Arrival to first scheduled step.", _L, buckets=_LATENCY
)
PREFILL_TIME = Histogram(
    "fleetgate_llm_request_prefill_time_seconds", "First scheduled step to first token.", _L, buckets=_LATENCY
)
DECODE_TIME = Histogram(
    "fleetgate_llm_request_decode_time_seconds", "First token to the request's end.", _L, buckets=_LATENCY
)


def observe_phases(label: str, arrival: float, scheduled: float | None, first: float | None, now: float) -> None:
    """A finished request's queue, prefill and decode times (vLLM's request phase histograms)."""
    if scheduled is None or first is None:
        return
    QUEUE_TIME.labels(label).observe(max(0.0, scheduled - arrival))
    PREFILL_TIME.labels(label).observe(max(0.0, first - scheduled))
    DECODE_TIME.labels(label).observe(max(0.0, now - first))
