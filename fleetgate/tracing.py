"""Request tracing with OpenTelemetry, off unless configured (`tracing.enabled`, `fleetgate[tracing]`).

`span(name, **attributes)` opens a child span of the current one, or does nothing (one shared no-op
context manager, no allocation) while tracing is off. `trace_headers()` is the W3C `traceparent`
(and `tracestate`) of the current span, for calls to other servers (remote backends).
`extract_context(headers)` reads a client's `traceparent`. Shared by every package, so backends can
propagate traces without importing the gateway. Attributes never carry a key or a prompt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

_tracer: Any = None  # an opentelemetry Tracer once `enable` ran
_propagator: Any = None
_use_span: Any = None
_current_span: Any = None
_NULL = contextlib.nullcontext()


def enabled() -> bool:
    return _tracer is not None


def enable(tracer: Any, propagator: Any, use_span: Any, current_span: Any) -> None:
    """Turn tracing on: an OpenTelemetry tracer, a text-map propagator, `trace.use_span` and
    `trace.get_current_span`."""
    global _tracer, _propagator, _use_span, _current_span
    _tracer, _propagator, _use_span, _current_span = tracer, propagator, use_span, current_span


def disable() -> None:
    global _tracer, _propagator, _use_span, _current_span
    _tracer = _propagator = _use_span = _current_span = None


def span(name: str, context: Any = None, **attributes: Any) -> Any:
    """A context manager around a span named `name` (a no-op while tracing is off).

    Inside a request that was not sampled, child spans are no-ops too: only the root span is made
    (it carries the sampling decision), so `sample_ratio` really lowers the cost.
    """
    if _tracer is None:
        return _NULL
    clean = {k: v for k, v in attributes.items() if v is not None}
    return _tracer.start_as_current_span(name, context=context, attributes=clean)


def child(name: str, **attributes: Any) -> Any:
    """A span under the current one, or a no-op when tracing is off or this trace is not sampled."""
    if _tracer is None or not _current_span().is_recording():
        return _NULL
    return _tracer.start_as_current_span(
        name, attributes={k: v for k, v in attributes.items() if v is not None}
    )


def start_span(name: str, context: Any = None, **attributes: Any) -> Any:
    """A started span the caller ends (None while tracing is off)."""
    if _tracer is None:
        return None
    return _tracer.start_span(
        name, context=context, attributes={k: v for k, v in attributes.items() if v is not None}
    )


def current(started: Any) -> Any:
    """Make a span from `start_span` the current one for a block, without ending it."""
    if _use_span is None or started is None:
        return _NULL
    return _use_span(started, end_on_exit=False)


def extract_context(headers: Mapping[str, str]) -> Any:
    """The trace context a client sent (`traceparent`), or None."""
    if _propagator is None or "traceparent" not in headers:
        return None
    return _propagator.extract(carrier=dict(headers))


def trace_headers() -> dict[str, str]:
    """`traceparent` (and `tracestate`) of the current span, for an outgoing call; {} when off."""
    if _propagator is None:
        return {}
    carrier: dict[str, str] = {}
    _propagator.inject(carrier)
    return carrier
