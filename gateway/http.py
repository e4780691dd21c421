"""HTTP plumbing shared by the protocol adapters: bounded body reads, request ids, access log.

This code runs on every request, on the event loop's one thread, so it avoids the framework's
conveniences where they cost more than the work: headers are read from the ASGI scope, the body
from the ASGI receive channel, and the hot inference routes answer with `RawResponse`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import structlog
from litestar import Request, Response

from gateway import metrics
from gateway.errors import GatewayError, Protocol, describe, exception_response

log = structlog.get_logger("fleetgate.access")

JSON_TYPES = ("application/json", "application/octet-stream", "")


async def read_body(
    request: Request,
    limit: int,
    *,
    allowed_types: tuple[str, ...] = JSON_TYPES,
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """Read the body, refusing with 413 before reading more than `limit` bytes.

    A declared Content-Length over the limit is refused without reading anything; a chunked body
    is counted as it arrives and refused as soon as it passes the limit.

    Args:
        request: the request whose body is read (once: the ASGI channel is consumed).
        limit: the most bytes accepted.
        allowed_types: accepted content types (without parameters).
        headers: the request's headers from `lower_headers`, when the caller has them already.
    """
    if headers is None:
        headers = lower_headers(request)
    ctype = headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in allowed_types:
        raise GatewayError(
            415, "unsupported_media_type", f"content type {ctype!r} is not supported; send application/json"
        )
    declared = headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise GatewayError(
                    413, "body_too_large", f"request body of {declared} bytes exceeds {limit} bytes"
                )
        except ValueError:
            raise GatewayError(400, "bad_content_length", "Content-Length is not a number") from None
    # Straight from the ASGI channel: Litestar's stream() adds an async generator per request.
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await request.receive()
        if message["type"] != "http.request":  # http.disconnect: the client went away
            raise GatewayError(400, "client_disconnected", "the client closed the connection mid-body")
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise GatewayError(413, "body_too_large", f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def lower_headers(request: Request) -> dict[str, str]:
    """The request's headers, names lower-cased (a repeated header keeps its last value).

    Read from the ASGI scope, whose names the server already lower-cases, rather than through
    Litestar's Headers object (built anew on each access).
    """
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.scope["headers"]}


class RawResponse:
    """A complete response as a bare ASGI app, for the hot inference routes.

    Litestar turns a returned `Response` into an ASGI response on every call (header containers,
    media-type and cookie handling); this sends the two ASGI messages directly. Handlers return it
    under a `-> ASGIApp` annotation; error paths may still return a Litestar `Response`.
    """

    __slots__ = ("body", "headers", "status")

    def __init__(self, body: bytes, status: int, media_type: str, headers: Mapping[str, str]) -> None:
        self.body = body
        self.status = status
        self.headers = [
            (b"content-type", media_type.encode("latin-1")),
            (b"content-length", str(len(body)).encode("latin-1")),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
        ]

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        body = b"" if scope.get("method") == "HEAD" else self.body
        await send({"type": "http.response.body", "body": body, "more_body": False})


#: model names that may appear as metric labels: those of every config this process has served.
#: Anything else a client writes in a URL or body is labelled "unknown", so made-up names cannot
#: grow /metrics or the caches below (both live as long as the process).
_metric_models: set[str] = set()


def register_metric_models(names: Iterable[str]) -> None:
    """Allow these model names as metric labels (called at start-up and on each reload)."""
    _metric_models.update(names)


def _model_label(model: str) -> str:
    return model if not model or model in _metric_models else "unknown"


#: metric children by label values: `labels()` validates and locks on every call
_request_counters: dict[tuple[str, ...], Any] = {}
_latency_histograms: dict[tuple[str, ...], Any] = {}


def _count(labels: tuple[str, str, str, str, str]) -> Any:
    child = _request_counters.get(labels)
    if child is None:
        child = _request_counters[labels] = metrics.REQUESTS.labels(*labels)
    return child


def _latency(labels: tuple[str, str, str]) -> Any:
    child = _latency_histograms.get(labels)
    if child is None:
        child = _latency_histograms[labels] = metrics.REQUEST_LATENCY.labels(*labels)
    return child


class Call:
    """One request's bookkeeping: id, timing, labels, and the single access-log line at the end."""

    __slots__ = (
        "protocol",
        "request_id",
        "echo_id",
        "started",
        "model",
        "deployment",
        "backend",
        "device",
        "tenant",
    )

    def __init__(self, protocol: Protocol, headers: Mapping[str, str]) -> None:
        self.protocol = protocol
        # The gateway's own id keys the request everywhere inside (engine, aborts, shadows): a
        # client-chosen id could collide with, reveal or abort another tenant's request. 128 random
        # bits as 32 hex digits, like uuid4().hex without building a UUID object.
        self.request_id = os.urandom(16).hex()
        #: what the response's x-request-id carries: the client's own id when it sent a sane one
        self.echo_id = _client_request_id(headers.get("x-request-id")) or self.request_id
        self.started = time.perf_counter()
        self.model = ""
        self.deployment = ""
        self.backend = ""
        self.device = ""
        self.tenant = ""

    def served_by(self, deployment: str, backend: str, device: str) -> None:
        self.deployment, self.backend, self.device = deployment, backend, device

    def done(self, status: int, error: str | None = None) -> None:
        elapsed = time.perf_counter() - self.started
        model = _model_label(self.model)
        _count((self.protocol, model, self.deployment, self.tenant, str(status))).inc()
        if model:
            _latency((self.protocol, model, self.deployment)).observe(elapsed)
        log.info(
            "request",
            request_id=self.request_id,
            client_request_id=self.echo_id if self.echo_id != self.request_id else None,
            protocol=self.protocol,
            tenant=self.tenant or None,
            model=self.model or None,
            deployment=self.deployment or None,
            backend=self.backend or None,
            device=self.device or None,
            status=status,
            latency_ms=round(elapsed * 1000, 3),
            error=error,
        )

    def fail(self, exc: BaseException) -> Response[bytes]:
        """Answer an exception in this call's protocol and log the line."""
        known = describe(exc)
        if known is None:
            log.exception("unhandled_error", request_id=self.request_id, exc_info=exc)
            self.done(500, "internal_error")
        else:
            self.done(known[0], known[1])
        response = exception_response(self.protocol, exc)
        response.headers["x-request-id"] = self.echo_id
        return response


#: a client's x-request-id is echoed and logged only when it is short and printable
_MAX_CLIENT_ID = 128


def _client_request_id(value: str | None) -> str | None:
    if not value or len(value) > _MAX_CLIENT_ID or not value.isprintable() or not value.isascii():
        return None
    return value
