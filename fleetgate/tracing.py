"""Request tracing through the OpenTelemetry SDK: a thin layer every package calls, free while off.

The spans are the SDK's (`opentelemetry-sdk`, the `tracing` extra); `gateway/observe/telemetry.py` builds
the `TracerProvider` (sampler, resource, batch processor, OTLP exporter) from the config and hands it
to `enable`. This module keeps the call sites small and the same whether tracing is on or off:

- `span(name, context, **attributes)`: a request's root span (kind SERVER) as a context manager;
  `context` is what `extract_context(headers)` read from the client (None: a new trace).
- `start_span(...)` / `current(span)`: a root span the caller ends later (a stream ends after the
  handler returned).
- `child(name, **attributes)`: a span under the current one (kind INTERNAL); a no-op when tracing
  is off or the trace is not sampled. The gateway's own steps (`step(...)`: authenticate, route, admit, queue) are made only while
  `enable(..., step_spans=True)`: each is an SDK span on every request, and what they would show
  (time before the backend) is the gap between the root span's start and the backend's span.
  `past_step(name, start_ns, end_ns)` records a step that ran before the root span was opened (a
  typed route's key check runs in a guard); the root span is then started at that step's start
  (`start_ns=` of `span` / `start_span`), so it still covers the whole request.
- `trace_headers()`: W3C `traceparent` / `tracestate` of the current span, for calls to other servers.

While tracing is off every call returns one shared no-op context manager, None or {} before
touching the SDK: no allocation, nothing imported. The SDK's provider is never installed as the
process's global one: a reload swaps it, and a program embedding the gateway keeps its own.
Attributes set to None are left out; a failed span gets the error's type as `error.type` and an
error status, never its message (it may quote input). Attributes never carry a key or a prompt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

_NULL = contextlib.nullcontext()


#: the SDK tracer while tracing is on, None while off (every function checks this first)
_tracer: Any = None
_step_spans = False  # whether `step` makes spans (`tracing.step_spans`)
_api: Any = None  # the OpenTelemetry API pieces this layer calls, bound by `enable`


class _Api:
    """The OpenTelemetry API functions and constants used per span, looked up once."""

    def __init__(self) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.attach = context.attach
        self.detach = context.detach
        self.empty = context.Context()  # the parent of a new trace: nothing current carries over
        self.in_context = trace.set_span_in_context
        self.current_span = trace.get_current_span
        self.server = trace.SpanKind.SERVER
        self.internal = trace.SpanKind.INTERNAL
        self.status = trace.Status
        self.error = trace.StatusCode.ERROR
        self.propagator = TraceContextTextMapPropagator()


class Span:
    """One SDK span as the gateway uses it; as a context manager, current for its block and ended
    (failed on an error) at its end."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Any) -> None:
        self._span = span  # the SDK's span (a NonRecordingSpan for a trace not sampled)

    @property
    def sdk_span(self) -> Any:
        return self._span

    @property
    def trace_id(self) -> int:
        return self._span.get_span_context().trace_id

    @property
    def span_id(self) -> int:
        return self._span.get_span_context().span_id

    def is_recording(self) -> bool:
        return self._span.is_recording()

    def set_attribute(self, key: str, value: Any) -> None:
        span = self._span
        if value is None or not span.is_recording():
            return  # an ended span would log a warning for each late attribute
        span.set_attribute(key, value)
        if key == "error.type":
            span.set_status(_api.status(_api.error, str(value)))

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def fail(self, error: BaseException) -> None:
        """Mark the span failed with the error's type (never its message: it may quote input)."""
        self.set_attribute("error.type", type(error).__name__)

    def end(self) -> None:
        """End the span (once; later calls do nothing): a sampled span goes to the exporter."""
        if self._span.is_recording():
            self._span.end()

    def __enter__(self) -> Span:
        self._token = _api.attach(_api.in_context(self._span))
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        _api.detach(self._token)
        if error is not None:
            self.fail(error)
        self.end()


class _Current:
    """Makes a span the current one for a block without ending it."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Span) -> None:
        self._span = span

    def __enter__(self) -> Span:
        self._token = _api.attach(_api.in_context(self._span.sdk_span))
        return self._span

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        _api.detach(self._token)


def enabled() -> bool:
    return _tracer is not None


def enable(provider: Any, step_spans: bool = False) -> None:
    """Turn tracing on: spans come from `provider` (an SDK `TracerProvider`, whose sampler decides
    what is kept and whose processors export); `step_spans` makes `step` spans too."""
    global _tracer, _step_spans, _api
    from fleetgate import __version__

    if _api is None:
        _api = _Api()
    _step_spans = step_spans
    _tracer = provider.get_tracer("fleetgate", __version__)


def disable() -> None:
    """Turn tracing off; spans still open end into the provider they came from."""
    global _tracer
    _tracer = None


def _clean(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attributes.items() if v is not None}


def start_span(name: str, context: Any = None, start_ns: int | None = None, **attributes: Any) -> Span | None:
    """A request's root span, started; the caller ends it (None while tracing is off).

    Sampling is the provider's: parent-based, a client's `traceparent` decides, else the ratio.
    `start_ns` (ns since the epoch) starts it in the past, where the request's first step began.
    """
    tracer = _tracer
    if tracer is None:
        return None
    parent = _api.empty if context is None else context
    return Span(tracer.start_span(name, parent, _api.server, _clean(attributes), start_time=start_ns))


def span(name: str, context: Any = None, start_ns: int | None = None, **attributes: Any) -> Any:
    """A request's root span as a context manager yielding it (a no-op yielding None while off)."""
    started = start_span(name, context, start_ns, **attributes)
    return _NULL if started is None else started


def child(name: str, **attributes: Any) -> Any:
    """A span under the current one, or a no-op when tracing is off or this trace is not sampled."""
    tracer = _tracer
    if tracer is None or not _api.current_span().is_recording():
        return _NULL
    return Span(tracer.start_span(name, None, _api.internal, _clean(attributes)))


def step(name: str, **attributes: Any) -> Any:
    """A span timing one of the gateway's own steps (authenticate, route, admit, queue): a `child`
    only while `step_spans` is on; otherwise the no-op (each would cost an SDK span a request)."""
    return child(name, **attributes) if _step_spans else _NULL


def past_step(name: str, start_ns: int, end_ns: int) -> None:
    """Record a step that already ran, from `start_ns` to `end_ns` (ns since the epoch), under the
    current span: a typed route's key check, made by a guard before the request's span existed.
    Made only where `step` would make a span."""
    tracer = _tracer
    if tracer is None or not _step_spans or not _api.current_span().is_recording():
        return
    tracer.start_span(name, None, _api.internal, start_time=start_ns).end(end_time=end_ns)


def current(started: Span | None) -> Any:
    """Make a span from `start_span` the current one for a block, without ending it."""
    return _NULL if started is None else _Current(started)


def extract_context(headers: Mapping[str, str]) -> Any:
    """The trace context a client sent (`traceparent`, `tracestate`, read by the SDK's W3C
    propagator) as an OpenTelemetry `Context`, or None when off, absent or invalid (an invalid one
    starts a new trace, as the W3C recommendation says)."""
    if _tracer is None or not headers.get("traceparent"):
        return None
    context = _api.propagator.extract(headers, _api.empty)
    return context if _api.current_span(context).get_span_context().is_valid else None


def trace_headers() -> dict[str, str]:
    """`traceparent` (and `tracestate`) of the current span, for an outgoing call; {} when off."""
    if _tracer is None:
        return {}
    headers: dict[str, str] = {}
    _api.propagator.inject(headers)
    return headers
