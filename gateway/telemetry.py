"""Sets tracing up from the config's `tracing:` section (fleetgate/tracing.py makes the spans).

Spans of the service `tracing.service_name`, sampled parent-based (a client's `traceparent`
decides; otherwise `sample_ratio`), sent in batches as OTLP/HTTP protobuf to `tracing.otlp_endpoint`
(fleetgate/span_export.py), encoded in C where a compiler could build `fleetgate/otlp_native.c`. An
OpenTelemetry SDK `SpanExporter` may be given instead (tests pass the SDK's in-memory one): each
span is then exported as it ends.

`TracingSwitch` holds a running gateway's tracing: a config reload changes it in place (turned on
or off, another sample ratio, another collector or service name) without a restart, so an operator
can raise sampling during an incident. Spans that ended before a change go where they were headed:
the replaced exporter sends what it holds before it is closed. `shutdown` sends what is left.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fleetgate import otlp_native, tracing
from fleetgate.otlp import OtlpHttpSender, SpanEncoder
from fleetgate.span_export import BatchSpanExport, SdkSpanExport
from gateway.config import TracingConfig

Export = BatchSpanExport | SdkSpanExport


def setup_tracing(config: TracingConfig, exporter: Any = None) -> Export | None:
    """Turn tracing on as configured; returns where spans go (None when tracing is off)."""
    if not config.enabled and exporter is None:
        return None
    export = _make_export(config, exporter)
    _enable(export, config.sample_ratio)
    return export


def _enable(export: Export, sample_ratio: float) -> None:
    """Spans to `export`: made in C where the encoder module built (`otlp_native`), and then, for
    the batch exporter, queued encoded by the span itself."""
    native = otlp_native.load()
    queue = export.native_queue() if native is not None and isinstance(export, BatchSpanExport) else None
    tracing.enable(export.add, sample_ratio, native=native, queue=queue)


def _make_export(config: TracingConfig, exporter: Any) -> Export:
    resource = {"service.name": config.service_name}
    if exporter is not None:
        return SdkSpanExport(exporter, resource)
    encoder = SpanEncoder(resource, native=otlp_native.load())
    return BatchSpanExport(
        encoder,
        OtlpHttpSender(config.otlp_endpoint),
        interval_s=config.export_interval_s,
        batch_size=config.export_batch_size,
        max_queued=config.max_queued_spans,
    )


def _same_export(a: TracingConfig, b: TracingConfig) -> bool:
    """Whether spans under `b` go out exactly as under `a` (only the sample ratio may differ)."""
    return a.enabled and b.enabled and _export_fields(a) == _export_fields(b)


def _export_fields(config: TracingConfig) -> tuple:
    return (
        config.otlp_endpoint,
        config.service_name,
        config.export_interval_s,
        config.export_batch_size,
        config.max_queued_spans,
    )


class TracingSwitch:
    """A gateway's tracing from start to shutdown, reconfigurable by a reload.

    With an SDK `exporter` given (tests, embedding programs), spans always go to it: a reload
    changes only the sample ratio.
    """

    def __init__(self, config: TracingConfig, exporter: Any = None) -> None:
        self._exporter = exporter
        self.config = config
        self.export = setup_tracing(config, exporter)

    async def reconfigure(self, config: TracingConfig) -> None:
        """Apply a reloaded `tracing:` section (awaits the flush of an exporter it replaces)."""
        if config == self.config:
            return
        old, old_config = self.export, self.config
        self.config = config
        if self._exporter is None and not config.enabled:
            tracing.disable()
            self.export = None
        elif old is not None and (self._exporter is not None or _same_export(old_config, config)):
            _enable(old, config.sample_ratio)  # same destination: only the ratio moves
            return
        else:
            self.export = _make_export(config, self._exporter)
            _enable(self.export, config.sample_ratio)
        if old is not None:
            # on a thread: a slow collector may take seconds to take the last batch
            await asyncio.to_thread(old.close)

    async def shutdown(self) -> None:
        """Turn tracing off and send what is queued (on a thread, as in `reconfigure`)."""
        tracing.disable()
        if self.export is not None:
            await asyncio.to_thread(self.export.close)
            self.export = None
