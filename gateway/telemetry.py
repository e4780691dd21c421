"""Sets OpenTelemetry up from the config's `tracing:` section (see fleetgate/tracing.py for spans).

A TracerProvider named `tracing.service_name`, sampling parent-based (a client's `traceparent`
decides; otherwise `sample_ratio`), exporting in batches over OTLP/HTTP to `tracing.otlp_endpoint`.
The exporter may be given instead (tests pass the SDK's in-memory one). `shutdown` flushes.
"""

from __future__ import annotations

from typing import Any

from backends.lazy import require
from fleetgate import tracing
from gateway.config import TracingConfig


def setup_tracing(config: TracingConfig, exporter: Any = None) -> Any:
    """Turn tracing on as configured; returns the provider (None when tracing is off)."""
    if not config.enabled and exporter is None:
        return None
    trace = require("opentelemetry.trace", extra="tracing")
    sdk_trace = require("opentelemetry.sdk.trace", extra="tracing")
    export = require("opentelemetry.sdk.trace.export", extra="tracing")
    sampling = require("opentelemetry.sdk.trace.sampling", extra="tracing")
    resources = require("opentelemetry.sdk.resources", extra="tracing")
    propagation = require("opentelemetry.trace.propagation.tracecontext", extra="tracing")
    if exporter is None:
        otlp = require("opentelemetry.exporter.otlp.proto.http.trace_exporter", extra="tracing")
        exporter = otlp.OTLPSpanExporter(endpoint=config.otlp_endpoint)
        processor = export.BatchSpanProcessor(exporter)
    else:
        processor = export.SimpleSpanProcessor(exporter)
    provider = sdk_trace.TracerProvider(
        resource=resources.Resource.create({"service.name": config.service_name}),
        sampler=sampling.ParentBased(sampling.TraceIdRatioBased(config.sample_ratio)),
    )
    provider.add_span_processor(processor)
    tracing.enable(
        provider.get_tracer("fleetgate"),
        propagation.TraceContextTextMapPropagator(),
        trace.use_span,
        trace.get_current_span,
    )
    return provider


def shutdown_tracing(provider: Any) -> None:
    """Flush what is buffered and turn tracing off."""
    tracing.disable()
    if provider is not None:
        provider.shutdown()
