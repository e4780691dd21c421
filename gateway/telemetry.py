"""Sets tracing up from the config's `tracing:` section (fleetgate/tracing.py makes the spans).

Spans of the service `tracing.service_name`, sampled parent-based (a client's `traceparent`
decides; otherwise `sample_ratio`), sent in batches as OTLP/HTTP protobuf to `tracing.otlp_endpoint`
(fleetgate/span_export.py), encoded in C where a compiler could build `fleetgate/otlp_native.c`. An
OpenTelemetry SDK `SpanExporter` may be given instead (tests pass the SDK's in-memory one): each
span is then exported as it ends. `shutdown_tracing` sends what is left.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleetgate import otlp_native, tracing
from fleetgate.otlp import OtlpHttpSender, SpanEncoder
from fleetgate.span_export import BatchSpanExport, SdkSpanExport
from gateway.config import TracingConfig


def setup_tracing(config: TracingConfig, exporter: Any = None) -> BatchSpanExport | SdkSpanExport | None:
    """Turn tracing on as configured; returns where spans go (None when tracing is off)."""
    if not config.enabled and exporter is None:
        return None
    resource = {"service.name": config.service_name}
    export: BatchSpanExport | SdkSpanExport
    if exporter is None:
        encoder = SpanEncoder(resource, native=otlp_native.load())
        export = BatchSpanExport(encoder, OtlpHttpSender(config.otlp_endpoint))
    else:
        export = SdkSpanExport(exporter, resource)
    tracing.enable(export.add, config.sample_ratio)
    return export


async def shutdown_tracing(export: BatchSpanExport | SdkSpanExport | None) -> None:
    """Turn tracing off and send what is queued (on a thread: a slow collector may take seconds,
    and the event loop may still be finishing other apps' work)."""
    tracing.disable()
    if export is not None:
        await asyncio.to_thread(export.close)
