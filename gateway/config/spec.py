"""The config's root Struct (`Config`) and its smaller sections: state, tracing, admin, deployments.

The `server:` section, the largest, has its own module (`gateway/config/server.py`); the other
sections' Structs belong to the rooms that use them (tenants to policies, models and graphs to the
router, batches to gateway/batches) and are only named here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from backends.sources import StorageSpec
from backends.spec import DeploymentSpec, SpecBase
from gateway.batches.config import BatchesConfig
from gateway.config.server import ServerConfig
from policies.budgets import BudgetAlerts
from policies.fair_queue import QueueSpec
from policies.jwt_auth import AuthSpec
from policies.leases import LeaseSettings, PartitionSettings
from policies.pricing import Pricing
from policies.types import TenantSpec
from router.graphs import GraphConfig
from router.spec import BreakerConfig, ModelConfig


class StateConfig(SpecBase):
    #: memory:// | sqlite:///path | redis://host:port/db
    url: str = "sqlite:///./var/fleetgate.db"
    #: when the store cannot be reached, keep admitting on this replica's local state for this many
    #: seconds before refusing (503); 0, the default, fails closed at once (per_request strategy:
    #: with leases, `partition` bounds what an outage may admit)
    fail_open_s: float = 0.0
    #: how admission takes capacity from the store: `strategy: leases` (the default) admits from
    #: slices held in memory and settles in batches every `flush_s`; `per_request` pays a store
    #: acquire and settle per request (docs/state.md)
    leases: LeaseSettings = msgspec.field(default_factory=LeaseSettings)
    #: edge partition tolerance, off (null) by default: {max_overspend_fraction, max_seconds} lets a
    #: gateway cut off from the store admit beyond its slices up to that bound (docs/state.md)
    partition: PartitionSettings | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("memory://", "sqlite:///", "redis://", "rediss://")):
            raise ValueError("url must start with memory://, sqlite:///, redis:// or rediss://")


class TracingConfig(SpecBase):
    """OpenTelemetry traces (`fleetgate[tracing]`) through the OpenTelemetry SDK: one trace per request.

    A field set here wins; a field left unset (None) takes the standard `OTEL_*` variable, then the
    SDK's default (docs/tracing.md)."""

    #: off by default: no span is made and nothing is imported
    enabled: bool = False
    #: the collector's traces URL (OTLP/HTTP: ending in /v1/traces); unset: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
    #: then OTEL_EXPORTER_OTLP_ENDPOINT (plus /v1/traces for HTTP), then http://localhost:4318/v1/traces
    otlp_endpoint: str | None = None
    #: "http/protobuf" or "grpc" (needs opentelemetry-exporter-otlp-proto-grpc); unset:
    #: OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, then OTEL_EXPORTER_OTLP_PROTOCOL, then http/protobuf
    protocol: Literal["http/protobuf", "grpc"] | None = None
    #: headers sent with every export (a collector's key: "${COLLECTOR_KEY}"); unset:
    #: OTEL_EXPORTER_OTLP_TRACES_HEADERS, then OTEL_EXPORTER_OTLP_HEADERS
    headers: dict[str, str] | None = None
    #: the resource's service.name; unset: OTEL_SERVICE_NAME (or OTEL_RESOURCE_ATTRIBUTES), then "fleetgate"
    service_name: str | None = None
    #: fraction of traces kept when the client sent no sampling decision: the sampler is
    #: ParentBased(TraceIdRatioBased(sample_ratio)); unset: OTEL_TRACES_SAMPLER and
    #: OTEL_TRACES_SAMPLER_ARG, then parentbased_always_on (every trace)
    sample_ratio: float | None = None
    #: also a span per gateway step (authenticate, route, admit, queue) under each request, for a
    #: closer look during an incident; off, a request has its root span and one per backend attempt
    step_spans: bool = False
    #: ended spans are sent every this many seconds, or sooner once `export_batch_size` wait
    export_interval_s: float = 1.0
    #: most spans in one export
    export_batch_size: int = 2048
    #: spans waiting past this (the collector slow or down) are dropped, never held
    max_queued_spans: int = 20_000

    def __post_init__(self) -> None:
        if self.sample_ratio is not None and not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError("sample_ratio must be in 0..1")
        if not self.export_interval_s > 0:
            raise ValueError("export_interval_s must be > 0")
        if not 1 <= self.export_batch_size <= self.max_queued_spans:
            raise ValueError("export_batch_size must be >= 1 and at most max_queued_spans")
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise ValueError("otlp_endpoint must be an http:// or https:// URL")


class AdminConfig(SpecBase):
    #: environment variable holding the admin API bearer key (also the console's sign-in, /admin/ui);
    #: no variable set = admin API and console off
    key_env: str = "FLEETGATE_ADMIN_KEY"
    #: environment variable holding a key that reads /metrics and readiness detail (and nothing else)
    metrics_key_env: str = "FLEETGATE_METRICS_KEY"
    #: serve /metrics without a key: only where the port is reachable by the operator alone
    public_metrics: bool = False
    #: wrong admin keys one client address may present per minute; beyond, its admin calls get 429
    max_failures_per_minute: int = 30

    def __post_init__(self) -> None:
        if self.max_failures_per_minute < 1:
            raise ValueError("max_failures_per_minute must be >= 1")


class DeploymentConfig(DeploymentSpec):
    #: the fair queue in front of this deployment (defaults apply when omitted)
    queue: QueueSpec | None = None
    #: prices in USD of the requests this deployment serves; wins over its model's (docs/pricing.md)
    pricing: Pricing | None = None


class Config(SpecBase):
    #: the listening ports, connection limits, timeouts and drain
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    #: where keys, limits, quotas and usage are kept (shared by workers and replicas)
    state: StateConfig = msgspec.field(default_factory=StateConfig)
    #: the admin API and console's keys
    admin: AdminConfig = msgspec.field(default_factory=AdminConfig)
    #: how callers may identify besides API keys: JWT / OIDC bearer tokens (docs/operations.md, Identity)
    auth: AuthSpec = msgspec.field(default_factory=AuthSpec)
    #: OpenTelemetry traces (docs/tracing.md)
    tracing: TracingConfig = msgspec.field(default_factory=TracingConfig)
    #: tenant name -> fair-share weight, limits, quotas and the models it may see
    tenants: dict[str, TenantSpec] = msgspec.field(default_factory=dict)
    #: deployment name -> one running model on one backend
    deployments: dict[str, DeploymentConfig] = msgspec.field(default_factory=dict)
    #: model name (what clients ask for) -> the deployments that serve it (docs/routing.md)
    models: dict[str, ModelConfig] = msgspec.field(default_factory=dict)
    #: models made of other models: steps, tensor mapping, cascades (router/graphs.py)
    graphs: dict[str, GraphConfig] = msgspec.field(default_factory=dict)
    #: circuit breakers of every deployment (changeable by reload)
    breakers: BreakerConfig = msgspec.field(default_factory=BreakerConfig)
    #: OpenAI Batch API: files directory and how jobs run (gateway/batches)
    batches: BatchesConfig = msgspec.field(default_factory=BatchesConfig)
    #: events when a tenant's or key's budget passes a share of itself (docs/pricing.md)
    budget_alerts: BudgetAlerts = msgspec.field(default_factory=BudgetAlerts)
    #: the cache that hf://, s3:// and https:// model addresses are fetched into (docs/model_sources.md)
    storage: StorageSpec = msgspec.field(default_factory=StorageSpec)


def with_listen_overrides(config: Config, listen: Mapping[str, Any]) -> Config:
    """`config` with `server.host` / `server.port` replaced by command-line values (`serve --host/--port`)."""
    if not listen:
        return config
    return msgspec.structs.replace(config, server=msgspec.structs.replace(config.server, **listen))
