"""Request tracing, off unless configured (`tracing.enabled`); spans exported as OpenTelemetry (OTLP).

fleetgate records its spans itself instead of through the OpenTelemetry Python SDK: the SDK costs
about 37 us per span on this path (measured, `bench/bench_tracing.py`), which is over a third of a
tensor request's gateway CPU at six spans a request. A span here is one small object: two clock
reads, a random id, a context variable set and reset, and an append to the exporter's buffer when it
ends; sending happens in batches on the exporter's thread (`fleetgate/span_export.py`). Where a C
compiler built `fleetgate/otlp_native.c`, spans are that module's `Span` type (`span_native.h`),
with this `Span`'s interface, root spans are started there too, and an ended span goes into the
exporter's queue already encoded, without a Python call: in process, tracing then adds about 21 us
(3.6 %) to a digits request's ~575 us of CPU instead of 50 us (8.6 %) (`bench/bench_tracing_inprocess.py`,
medians of paired rounds). `enable(..., native=...)` chooses.
The trace model is OpenTelemetry's: W3C `traceparent` in and out, parent-based ratio sampling as
the SDK's `ParentBased(TraceIdRatioBased)`, OTLP on the wire, so collectors and backends see no
difference.

API, shared by every package (backends propagate traces without importing the gateway):
- `span(name, context, **attributes)`: a request's root span as a context manager; `context` is
  what `extract_context(headers)` read from the client (or None for a new trace).
- `start_span(...)` / `current(span)`: a root span the caller ends later (a stream ends after the
  handler returned).
- `child(name, **attributes)`: a span under the current one; a no-op when tracing is off or the
  trace is not sampled.
- `trace_headers()`: `traceparent` / `tracestate` of the current span, for calls to other servers.
While tracing is off every call returns one shared no-op context manager or None: no allocation.
Attributes never carry a key or a prompt.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import time
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, NamedTuple

#: an ended, sampled span goes here (the exporter's buffer); None while tracing is off
_sink: Callable[[Span], None] | None = None
_ratio_bound = 1 << 64  # sample when the trace id's low 64 bits are below this (ratio 1.0)
_current: ContextVar[Span | None] = ContextVar("fleetgate_span", default=None)
_NULL = contextlib.nullcontext()
_random = random.Random()  # seeded from the OS; ids need to be unique, not secret

KIND_INTERNAL = 1
KIND_SERVER = 2

# version "00" exactly as the W3C spec writes it; later versions keep these four fields first
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_MAX_TRACESTATE = 512


class RemoteParent(NamedTuple):
    """The trace a client's `traceparent` names: its ids, its sampling decision, its `tracestate`."""

    trace_id: int
    span_id: int
    sampled: bool
    tracestate: str


class Span:
    """One operation of a trace, from its start to `end()`.

    A span of a trace that is not sampled records nothing (`recording` False) but still carries the
    trace's ids, so the decision travels on to remote backends in `traceparent`. Attributes set to
    None are left out when the span is exported (filtered there, off the request's path). A failed
    span has the error's type as `error.type`; exporters give it an error status.
    """

    __slots__ = (
        "_token",
        "attributes",
        "end_ns",
        "kind",
        "name",
        "parent_id",
        "recording",
        "span_id",
        "start_ns",
        "trace_id",
        "tracestate",
    )

    def __init__(
        self,
        name: str,
        trace_id: int,
        parent_id: int,
        recording: bool,
        attributes: dict[str, Any],
        kind: int,
        tracestate: str,
    ) -> None:
        self.name = name
        self.trace_id = trace_id
        self.span_id = _random.getrandbits(64) or 1
        self.parent_id = parent_id
        self.recording = recording
        self.attributes = attributes
        self.kind = kind
        self.tracestate = tracestate
        self.start_ns = time.time_ns()
        self.end_ns = 0

    @property
    def remote_parent(self) -> bool:
        """Whether the parent is another process's span (only a request's root span has one)."""
        return self.kind == KIND_SERVER and self.parent_id != 0

    @property
    def error(self) -> str | None:
        return self.attributes.get("error.type")

    def is_recording(self) -> bool:
        return self.recording and not self.end_ns

    def set_attribute(self, key: str, value: Any) -> None:
        if self.recording:
            self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if self.recording:
            self.attributes.update(attributes)

    def fail(self, error: BaseException) -> None:
        """Mark the span failed with the error's type (never its message: it may quote input)."""
        self.set_attribute("error.type", type(error).__name__)

    def end(self) -> None:
        """End the span (once; later calls do nothing) and hand it to the exporter if sampled."""
        if self.end_ns:
            return
        self.end_ns = time.time_ns()
        if self.recording and _sink is not None:
            _sink(self)

    # as a context manager: current for the block, ended (and failed on an error) at its end
    def __enter__(self) -> Span:
        self._token = _current.set(self)
        return self

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        _current.reset(self._token)
        if error is not None and self.recording:
            self.attributes["error.type"] = type(error).__name__
        if not self.end_ns:
            self.end_ns = time.time_ns()
            if self.recording and _sink is not None:
                _sink(self)

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.recording else '00'}"


#: the type `start_span` makes: `Span`, or the C module's `Span` while `enable` was given one
_span_type: Callable[..., Any] = Span
_native: Any = None


class _Current:
    """Makes a span the current one for a block without ending it."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Span) -> None:
        self._span = span

    def __enter__(self) -> Span:
        self._token = _current.set(self._span)
        return self._span

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> None:
        _current.reset(self._token)


def enabled() -> bool:
    return _sink is not None


def enable(
    sink: Callable[[Span], None],
    sample_ratio: float = 1.0,
    native: Any = None,
    queue: Mapping[str, Any] | None = None,
) -> None:
    """Turn tracing on: every ended, sampled span is passed to `sink`; traces the client did not
    decide are kept with probability `sample_ratio` (by trace id, as OpenTelemetry's samplers).

    `native` (the module `otlp_native.load()` returns) makes spans in C; `queue` (a batch exporter's
    `native_queue()`) then has them put into its queue encoded, instead of passed to `sink`.
    """
    global _sink, _ratio_bound, _span_type, _native, child, start_span, span
    ratio_bound = round(sample_ratio * (1 << 64))
    if native is not None:
        # seeded from the OS in each process: forked workers must not repeat each other's ids
        native.bind(_current, _NULL, _python_child, int.from_bytes(os.urandom(8), "little"))
        native.set_sink(sink, **(queue or {}))  # refuses bad arguments before anything switched
        # a negative ratio keeps nothing, as in `_python_start_span`; the C module refuses a negative
        # bound, which here, after its sink switched, would leave C spans on behind `disable`
        native.set_sample_bound(max(ratio_bound, 0))
        _span_type, _native = native.Span, native
        child, start_span, span = native.child, native.start_span, native.span
    else:
        if _native is not None:
            _native.set_sink(sink)  # C spans still open end into the new sink
        _span_type, child, start_span, span = Span, _python_child, _python_start_span, _python_span
    _ratio_bound = ratio_bound
    _sink = sink  # last: `enabled()` is true only once everything above took


def disable() -> None:
    global _sink, _span_type, child, start_span, span
    _sink = None
    if _native is not None:
        _native.set_sink()  # C spans still open end into nothing, as Python ones do
    _span_type, child, start_span, span = Span, _python_child, _python_start_span, _python_span


def _python_start_span(name: str, context: RemoteParent | None = None, **attributes: Any) -> Span | None:
    """A request's root span, started; the caller ends it (None while tracing is off).

    Sampling is parent-based: a client's `traceparent` decides; otherwise `sample_ratio` does.
    """
    if _sink is None:
        return None
    if context is not None:
        return _span_type(
            name,
            context.trace_id,
            context.span_id,
            context.sampled,
            attributes,
            KIND_SERVER,
            context.tracestate,
        )
    trace_id = _random.getrandbits(128) or 1
    sampled = (trace_id & 0xFFFF_FFFF_FFFF_FFFF) < _ratio_bound
    return _span_type(name, trace_id, 0, sampled, attributes if sampled else {}, KIND_SERVER, "")


def _python_span(name: str, context: RemoteParent | None = None, **attributes: Any) -> Any:
    """A request's root span as a context manager yielding it (a no-op yielding None while off)."""
    started = _python_start_span(name, context, **attributes)
    return _NULL if started is None else started


#: `start_span(name, context=None, **attributes)` and `span(...)`: the functions above, or the C
#: module's (same rules, the trace id from its generator) while `enable` was given one
start_span: Callable[..., Any] = _python_start_span
span: Callable[..., Any] = _python_span


def _python_child(name: str, **attributes: Any) -> Any:
    """A span under the current one, or a no-op when tracing is off or this trace is not sampled."""
    parent = _current.get()
    if parent is None or not parent.recording:
        return _NULL
    return Span(name, parent.trace_id, parent.span_id, True, attributes, KIND_INTERNAL, parent.tracestate)


#: `child(name, **attributes)`: `_python_child`, or the C module's `child` (same behaviour) while
#: `enable` was given one; a module attribute, looked up at each call, so the switch needs no wrapper
child: Callable[..., Any] = _python_child


def current(started: Span | None) -> Any:
    """Make a span from `start_span` the current one for a block, without ending it."""
    return _NULL if started is None else _Current(started)


def extract_context(headers: Mapping[str, str]) -> RemoteParent | None:
    """The trace context a client sent (`traceparent`, `tracestate`), or None when absent or invalid
    (an invalid one starts a new trace, as the W3C recommendation says)."""
    if _sink is None:
        return None
    value = headers.get("traceparent")
    if not value:
        return None
    found = _TRACEPARENT.fullmatch(value.strip())
    if found is None:
        return None
    version, trace_hex, span_hex, flags, rest = found.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    tracestate = headers.get("tracestate", "")
    if len(tracestate) > _MAX_TRACESTATE:
        tracestate = ""  # a list too long to pass on whole is dropped rather than cut mid-entry
    return RemoteParent(trace_id, span_id, bool(int(flags, 16) & 1), tracestate)


def trace_headers() -> dict[str, str]:
    """`traceparent` (and `tracestate`) of the current span, for an outgoing call; {} when off."""
    if _sink is None:
        return {}
    active = _current.get()
    if active is None:
        return {}
    headers = {"traceparent": active.traceparent}
    if active.tracestate:
        headers["tracestate"] = active.tracestate
    return headers
