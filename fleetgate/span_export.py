"""Where ended spans go: batched to an OTLP collector on a thread of their own, or to an SDK exporter.

`BatchSpanExport` is what a configured gateway uses: `add` (called as a span ends, on the request's
path) encodes the span (`fleetgate/otlp.py`, a microsecond or two) and queues its bytes; a thread
wakes every `interval_s`, or sooner once `batch_size` spans wait, and sends them (the config's
`tracing.export_*` settings). Encoding at once rather than on the thread is on purpose: a span object kept alive for a second outlives the young
garbage-collector generations, and thousands of them made the full collections of the gateway's
heap frequent enough to cost more than the encoding (measured: 145 us of CPU a request at c=16
queueing spans, against the ~25 us spans and encoding cost). When the collector is slow or down, spans
beyond `max_queued` are dropped and counted, never held without bound; a failed send is logged
(at most once a minute) and its spans dropped, as is a span whose attributes cannot be encoded
(the request it belongs to is answered as usual). `close` sends what is left.

`SdkSpanExport` hands each span, as it ends, to an OpenTelemetry SDK `SpanExporter` as a
`ReadableSpan` (tests use the SDK's in-memory exporter; a program embedding the gateway may pass
any other). It needs `opentelemetry-sdk` (the `tracing` extra).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import structlog

from fleetgate.otlp import OtlpHttpSender, SpanEncoder
from fleetgate.tracing import KIND_SERVER, Span

log = structlog.get_logger("fleetgate.tracing")


class BatchSpanExport:
    """Ended spans, encoded and sent in batches off the request path."""

    def __init__(
        self,
        encoder: SpanEncoder,
        sender: OtlpHttpSender,
        interval_s: float = 1.0,
        batch_size: int = 2048,
        max_queued: int = 20_000,
    ) -> None:
        self._encoder = encoder
        self._sender = sender
        self._interval_s = interval_s
        self._batch_size = batch_size
        self._max_queued = max_queued
        self._queued: deque[bytes] = deque()  # appends and pops are thread-safe
        self._wake = threading.Event()
        self._closing = False
        self._last_warning = 0.0
        self.sent = 0  # spans a collector accepted
        # spans lost, counted apart by the one thread that loses each kind (no shared increment)
        self._dropped_full = 0  # the queue was full (the request's thread)
        self._dropped_unencodable = 0  # an attribute could not be encoded (the request's thread)
        self._dropped_failed = 0  # their send failed (the export thread)
        self._last_encode_warning = 0.0
        self._thread = threading.Thread(target=self._run, name="fleetgate-span-export", daemon=True)
        self._thread.start()

    def add(self, span: Span) -> None:
        """Encode and queue an ended span (called on the request's path)."""
        queued = self._queued
        if len(queued) >= self._max_queued:
            self._dropped_full += 1
            return
        try:
            encoded = self._encoder.span(span)
        except Exception as exc:  # noqa: BLE001 - a span that cannot be encoded never fails its request
            self._unencodable(span.name, exc)
            return
        queued.append(encoded)
        if len(queued) == self._batch_size:
            self._wake.set()

    def native_queue(self) -> dict[str, Any]:
        """What C spans need to do `add`'s work themselves (`tracing.enable(..., queue=...)`): the
        queue, its limits, and callbacks for the wake-up, a full queue and an unencodable span."""
        return {
            "queue": self._queued,
            "max_queued": self._max_queued,
            "batch_size": self._batch_size,
            "wake": self._wake.set,
            "on_full": self._count_full,
            "on_unencodable": self._unencodable,
        }

    def _count_full(self) -> None:
        self._dropped_full += 1

    def _unencodable(self, name: str, error: BaseException) -> None:
        self._dropped_unencodable += 1
        now = time.monotonic()
        if now - self._last_encode_warning >= 60.0:
            self._last_encode_warning = now
            log.warning("trace_span_unencodable", span=name, error=type(error).__name__)

    @property
    def dropped(self) -> int:
        """Spans lost to a full queue, an attribute that could not be encoded or a failed send."""
        return self._dropped_full + self._dropped_unencodable + self._dropped_failed

    def _run(self) -> None:
        while not self._closing:
            self._wake.wait(self._interval_s)
            self._wake.clear()
            self._send_queued()
        self._send_queued()

    def _send_queued(self) -> None:
        queued = self._queued
        remaining = len(queued)  # what waits now; later spans go in the next round
        while remaining > 0:
            batch = [queued.popleft() for _ in range(min(remaining, self._batch_size))]
            remaining -= len(batch)
            try:
                self._sender.send(self._encoder.request(batch))
                self.sent += len(batch)
            except Exception as exc:  # noqa: BLE001 - a collector's failure never reaches requests
                self._dropped_failed += len(batch)
                now = time.monotonic()
                if now - self._last_warning >= 60.0:
                    self._last_warning = now
                    log.warning("trace_export_failed", error=str(exc), spans_dropped=self.dropped)

    def close(self, timeout_s: float = 10.0) -> None:
        """Send what is queued, then stop the thread."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)
        self._sender.close()


class SdkSpanExport:
    """Each ended span, as an SDK `ReadableSpan`, exported at once by an SDK `SpanExporter`."""

    def __init__(self, exporter: Any, resource: dict[str, Any]) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self._exporter = exporter
        self._trace = trace
        self._readable = ReadableSpan
        self._resource = Resource.create(resource)
        self._scope = InstrumentationScope("fleetgate")

    def add(self, span: Span) -> None:
        trace = self._trace
        state = trace.TraceState.from_header([span.tracestate]) if span.tracestate else None
        flags = trace.TraceFlags(trace.TraceFlags.SAMPLED)
        context = trace.SpanContext(span.trace_id, span.span_id, False, flags, state)
        parent = (
            trace.SpanContext(span.trace_id, span.parent_id, span.remote_parent, flags, state)
            if span.parent_id
            else None
        )
        status = (
            trace.Status(trace.StatusCode.ERROR, span.error)
            if span.error is not None
            else trace.Status(trace.StatusCode.UNSET)
        )
        readable = self._readable(
            name=span.name,
            context=context,
            parent=parent,
            resource=self._resource,
            attributes={k: v for k, v in span.attributes.items() if v is not None},
            kind=trace.SpanKind.SERVER if span.kind == KIND_SERVER else trace.SpanKind.INTERNAL,
            status=status,
            start_time=span.start_ns,
            end_time=span.end_ns,
            instrumentation_scope=self._scope,
        )
        self._exporter.export([readable])

    def close(self, timeout_s: float = 10.0) -> None:
        self._exporter.shutdown()
