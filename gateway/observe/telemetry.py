"""Sets tracing up from the config's `tracing:` section, with the OpenTelemetry SDK.

A `TracerProvider` whose sampler is ParentBased(TraceIdRatioBased(`sample_ratio`)) (a client's
`traceparent` decides; otherwise the ratio), whose resource names the service, and whose
`BatchSpanProcessor` sends ended spans off the request path through the OTLP exporter
(`http/protobuf`, or `grpc` with `opentelemetry-exporter-otlp-proto-grpc` installed). Each setting
left unset in the config is taken from the standard `OTEL_*` variables by the SDK itself, then the
SDK's default (the precedence is in docs/tracing.md). An SDK `SpanExporter` may be given instead
(tests pass the in-memory one): each span is then exported as it ends (`SimpleSpanProcessor`).

`TracingSwitch` holds a running gateway's tracing: a config reload changes it in place (turned on
or off, another sample ratio, another collector or service name) without a restart, so an operator
can raise sampling during an incident. A change of the sample ratio or of `step_spans` alone keeps
the span processor, so nothing in flight is lost; another destination gets a new provider, and the
replaced one sends what it holds before it is shut down. `shutdown` sends what is left.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from fleetgate import tracing
from gateway.config import ConfigError, TracingConfig

_PROTOCOLS = ("http/protobuf", "grpc")


def protocol_of(config: TracingConfig, environ: Any = os.environ) -> str:
    """The export protocol: the config's, else OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, else
    OTEL_EXPORTER_OTLP_PROTOCOL, else http/protobuf; one this gateway cannot speak is refused."""
    protocol = (
        config.protocol
        or environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol not in _PROTOCOLS:
        raise ConfigError(f"OTLP protocol {protocol!r} is not supported: use one of {', '.join(_PROTOCOLS)}")
    return protocol


def _span_exporter(config: TracingConfig) -> Any:
    """The OTLP exporter; an argument left None is read by the exporter from `OTEL_EXPORTER_OTLP_*`."""
    headers = dict(config.headers) if config.headers is not None else None
    if protocol_of(config) == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        except ImportError as exc:
            raise ConfigError("tracing protocol grpc needs opentelemetry-exporter-otlp-proto-grpc") from exc
        return Grpc(endpoint=config.otlp_endpoint, headers=headers)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.otlp_endpoint, headers=headers)


def _processor(config: TracingConfig, exporter: Any) -> Any:
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if exporter is not None:
        return SimpleSpanProcessor(exporter)
    return BatchSpanProcessor(
        _span_exporter(config),
        max_queue_size=config.max_queued_spans,
        schedule_delay_millis=config.export_interval_s * 1000,
        max_export_batch_size=config.export_batch_size,
    )


def _provider(config: TracingConfig, processor: Any) -> Any:
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({})  # OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME
    if config.service_name is not None:
        resource = resource.merge(Resource({SERVICE_NAME: config.service_name}))
    elif str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "fleetgate"}))  # no variable named one
    # None lets the SDK read OTEL_TRACES_SAMPLER / _ARG (default: parentbased_always_on)
    sampler = None if config.sample_ratio is None else ParentBased(TraceIdRatioBased(config.sample_ratio))
    # shut down by TracingSwitch, not at exit: a handler per reload would keep every old provider
    provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(processor)
    return provider


def _same_export(a: TracingConfig, b: TracingConfig) -> bool:
    """Whether spans under `b` go out exactly as under `a` (only sampling and step spans differ)."""
    return a.enabled and b.enabled and _export_fields(a) == _export_fields(b)


def _export_fields(config: TracingConfig) -> tuple:
    return (
        config.otlp_endpoint,
        config.protocol,
        config.headers,
        config.service_name,
        config.export_interval_s,
        config.export_batch_size,
        config.max_queued_spans,
    )


class TracingSwitch:
    """A gateway's tracing from start to shutdown, reconfigurable by a reload.

    With an SDK `exporter` given (tests, embedding programs), spans always go to it: a reload
    changes only the sampling (and the service name).
    """

    def __init__(self, config: TracingConfig, exporter: Any = None) -> None:
        self._exporter = exporter
        self.config = config
        self._processor: Any = None
        self.provider: Any = None
        if config.enabled or exporter is not None:
            self._processor = _processor(config, exporter)
            self.provider = _provider(config, self._processor)
            tracing.enable(self.provider, step_spans=config.step_spans)

    async def reconfigure(self, config: TracingConfig) -> None:
        """Apply a reloaded `tracing:` section (awaits the flush of a provider it replaces). A
        section that cannot be served (a protocol this gateway cannot speak) raises `ConfigError`
        before anything changed."""
        if config == self.config:
            return
        old_provider = self.provider
        if self._exporter is None and not config.enabled:
            provider = processor = None
        elif old_provider is not None and (self._exporter is not None or _same_export(self.config, config)):
            # same destination: a new provider (sampler, resource) over the same processor, so
            # spans started under the old one still end into it; nothing to shut down
            processor = self._processor
            provider = _provider(config, processor)
            old_provider = None
        else:
            processor = _processor(config, self._exporter)
            provider = _provider(config, processor)
        self.config, self.provider, self._processor = config, provider, processor
        if provider is None:
            tracing.disable()
        else:
            tracing.enable(provider, step_spans=config.step_spans)
        if old_provider is not None:
            # on a thread: a slow collector may take seconds to take the last batch
            await asyncio.to_thread(old_provider.shutdown)

    async def shutdown(self) -> None:
        """Turn tracing off and send what is queued (on a thread, as in `reconfigure`)."""
        tracing.disable()
        if self.provider is not None:
            await asyncio.to_thread(self.provider.shutdown)
            self.provider = self._processor = None
