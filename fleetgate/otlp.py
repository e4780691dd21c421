"""OTLP trace export: spans encoded as an `ExportTraceServiceRequest` (protobuf) and POSTed over HTTP.

The encoder writes the protobuf wire format directly for the few messages a span needs (OTLP's
`opentelemetry/proto/trace/v1/trace.proto`, field numbers below): 1-4 us a span, where building the
generated message classes costs ten times that. Attribute key/value pairs repeat from span to span
(tenant, model, deployment, a status code), so their encoded bytes are cached. Where a C compiler
is available the same encoding runs in C (`otlp_native.c`, several times faster); the tests check
that both write the same bytes and decode what is sent with the `opentelemetry-proto` classes.
"""

from __future__ import annotations

import http.client
import struct
import urllib.parse
from collections.abc import Iterable, Mapping
from typing import Any

from fleetgate.tracing import KIND_SERVER, Span

# wire types
_VARINT, _FIXED64, _LEN = 0, 1, 2
_STATUS_ERROR = 2  # Status.StatusCode.STATUS_CODE_ERROR
_CACHE_LIMIT = 4096  # distinct encoded attributes kept (tenant x model x deployment values repeat)
_SMALL_INT = 1024  # int attributes below this (in magnitude) are cached: status codes, costs
#: attributes whose values differ on every request: caching them would only churn the cache
_UNIQUE_KEYS = frozenset({"fleetgate.request_id"})


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_SMALL_VARINTS = [_encode_varint(i) for i in range(1 << 14)]  # every one- and two-byte varint
# A span's fixed-size fields, packed at once (protobuf readers take fields in any order):
# 1 trace_id (16 bytes, as two big-endian halves), 2 span_id, 4 parent_span_id ...
_IDS = struct.Struct(">BBQQBBQ")
_IDS_AND_PARENT = struct.Struct(">BBQQBBQBBQ")
# ... and 6 kind, 7 start_time_unix_nano, 8 end_time_unix_nano (fixed64), 16 flags (fixed32)
_KIND_TIMES_FLAGS = struct.Struct("<BBBQBQBBI")
_LOW64 = 0xFFFF_FFFF_FFFF_FFFF


def _varint(value: int) -> bytes:
    return _SMALL_VARINTS[value] if value < 16384 else _encode_varint(value)


def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _len_field(field: int, payload: bytes) -> bytes:
    return _tag(field, _LEN) + _varint(len(payload)) + payload


def _any_value(value: Any) -> bytes:
    """An OTLP `AnyValue`: string 1, bool 2, int 3, double 4 (other types are sent as strings)."""
    if isinstance(value, bool):
        return _tag(2, _VARINT) + (b"\x01" if value else b"\x00")
    if isinstance(value, int):
        return _tag(3, _VARINT) + _varint(value & 0xFFFF_FFFF_FFFF_FFFF)  # int64, two's complement
    if isinstance(value, float):
        return _tag(4, _FIXED64) + struct.pack("<d", value)
    return _len_field(1, str(value).encode())


def _string_attribute(key: str, value: str) -> bytes:
    """`_len_field(9, _key_value(key, value))` for a string value, without the type dispatch: 0.7 us
    instead of 1.7 here, paid by the request id (never cached) on every traced request."""
    encoded_key, encoded_value = key.encode(), value.encode()
    any_value = b"\x0a" + _varint(len(encoded_value)) + encoded_value
    key_value = (
        b"\x0a" + _varint(len(encoded_key)) + encoded_key + b"\x12" + _varint(len(any_value)) + any_value
    )
    return b"\x4a" + _varint(len(key_value)) + key_value


def _key_value(key: str, value: Any) -> bytes:
    """A `KeyValue` message's bytes (key 1, value 2)."""
    return _len_field(1, key.encode()) + _len_field(2, _any_value(value))


class SpanEncoder:
    """Encodes batches of spans for one service (its resource and instrumentation scope).

    `native` (the module `otlp_native.load()` returns) encodes each span in C, with the same bytes;
    without it the Python encoder below serves.
    """

    def __init__(
        self,
        resource: Mapping[str, Any],
        scope_name: str = "fleetgate",
        scope_version: str = "",
        native: Any = None,
    ) -> None:
        resource_bytes = b"".join(_len_field(1, _key_value(k, v)) for k, v in resource.items())
        scope = _len_field(1, scope_name.encode()) + (
            _len_field(2, scope_version.encode()) if scope_version else b""
        )
        self._resource_field = _len_field(1, resource_bytes)  # ResourceSpans.resource
        self._scope_field = _len_field(1, scope)  # ScopeSpans.scope
        self._attributes: dict[tuple[str, str | int], bytes] = {}
        self._names: dict[str, bytes] = {}
        #: how a span is encoded: in C when given, else in Python (`python_span`)
        self.span = native.encode_span if native is not None else self.python_span

    def _attribute(self, key: str, value: Any) -> bytes:
        """A `Span.attributes` entry's bytes, kept for next time when its value is a string (tenant,
        model, deployment) or a small int (a status code, a cost); the request id, unique to each
        request, and larger ints (token counts) are not kept: they would only churn the cache."""
        cls = value.__class__
        if cls is str:
            encoded = _string_attribute(key, value)
        else:
            encoded = _len_field(9, _key_value(key, value))
        if (cls is str and key not in _UNIQUE_KEYS) or (cls is int and -_SMALL_INT < value < _SMALL_INT):
            if len(self._attributes) >= _CACHE_LIMIT:
                self._attributes.clear()
            # only str and int values are kept and looked up: 1, 1.0 and True hash alike
            self._attributes[(key, value)] = encoded
        return encoded

    def python_span(self, span: Span) -> bytes:
        """One `Span` message's bytes, as a `ScopeSpans.spans` entry."""
        name, kind, parent_id = span.name, span.kind, span.parent_id
        encoded_name = self._names.get(name)
        if encoded_name is None:
            encoded_name = self._names[name] = _len_field(5, name.encode())
        trace_id = span.trace_id
        high, low = trace_id >> 64, trace_id & _LOW64
        if parent_id:
            ids = _IDS_AND_PARENT.pack(0x0A, 16, high, low, 0x12, 8, span.span_id, 0x22, 8, parent_id)
        else:
            ids = _IDS.pack(0x0A, 16, high, low, 0x12, 8, span.span_id)
        # flags: the sampled bit, and bits 8-9 saying whether the parent is remote (OTLP 1.1+);
        # only a request's root span has a remote parent
        flags = 0x301 if parent_id and kind == KIND_SERVER else 0x101
        fixed = _KIND_TIMES_FLAGS.pack(0x30, kind, 0x39, span.start_ns, 0x41, span.end_ns, 0x85, 0x01, flags)
        parts = [ids, fixed, encoded_name]
        if span.tracestate:
            parts.append(_len_field(3, span.tracestate.encode()))
        cached, attribute = self._attributes, self._attribute
        attributes = span.attributes
        for key, value in attributes.items():
            cls = value.__class__
            encoded = cached.get((key, value)) if cls is str or cls is int else None
            if encoded is not None:
                parts.append(encoded)
            elif value is not None:
                parts.append(attribute(key, value))
        error = attributes.get("error.type")
        if error is not None:  # 15 status {message 2, code 3}
            parts.append(_len_field(15, _len_field(2, error.encode()) + b"\x18" + bytes((_STATUS_ERROR,))))
        body = b"".join(parts)
        return b"\x12" + _varint(len(body)) + body

    def request(self, encoded_spans: Iterable[bytes]) -> bytes:
        """An `ExportTraceServiceRequest` of spans encoded by `span`, under this service's resource."""
        scope_spans = self._scope_field + b"".join(encoded_spans)
        resource_spans = self._resource_field + _len_field(2, scope_spans)
        return _len_field(1, resource_spans)


class OtlpHttpSender:
    """POSTs encoded requests to a collector's OTLP/HTTP traces endpoint over one kept-alive connection."""

    def __init__(self, endpoint: str, timeout_s: float = 10.0) -> None:
        url = urllib.parse.urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"otlp_endpoint must be an http(s) URL, not {endpoint!r}")
        self._https = url.scheme == "https"
        self._host = url.hostname
        self._port = url.port
        self._path = (url.path or "/v1/traces") + (f"?{url.query}" if url.query else "")
        self._timeout_s = timeout_s
        self._connection: http.client.HTTPConnection | None = None

    def send(self, body: bytes) -> None:
        """Send one request; raises OSError or http.client.HTTPException, or RuntimeError naming the
        status a collector refused it with. A kept connection the collector closed is retried once."""
        for attempt in (0, 1):
            connection = self._connection or self._connect()
            try:
                connection.request("POST", self._path, body, {"content-type": "application/x-protobuf"})
                response = connection.getresponse()
                response.read()
            except (OSError, http.client.HTTPException):
                self.close()
                if attempt:
                    raise
                continue
            if response.will_close:
                self.close()
            if not 200 <= response.status < 300:
                raise RuntimeError(f"the collector answered {response.status} {response.reason}")
            return

    def _connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        self._connection = kind(self._host, self._port, timeout=self._timeout_s)
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None
