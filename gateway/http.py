"""HTTP plumbing shared by the protocol adapters: bounded body reads, request ids, access log."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping

import structlog
from litestar import Request, Response

from gateway import metrics
from gateway.errors import GatewayError, Protocol, describe, exception_response

log = structlog.get_logger("fleetgate.access")

JSON_TYPES = ("application/json", "application/octet-stream", "")


async def read_body(request: Request, limit: int, *, allowed_types: tuple[str, ...] = JSON_TYPES) -> bytes:
    """Read the body, refusing with 413 before reading more than `limit` bytes.

    A declared Content-Length over the limit is refused without reading anything; a chunked body
    is counted as it arrives and refused as soon as it passes the limit.
    """
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in allowed_types:
        raise GatewayError(
            415, "unsupported_media_type", f"content type {ctype!r} is not supported; send application/json"
        )
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise GatewayError(
                    413, "body_too_large", f"request body of {declared} bytes exceeds {limit} bytes"
                )
        except ValueError:
            raise GatewayError(400, "bad_content_length", "Content-Length is not a number") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, "body_too_large", f"request body exceeds {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def lower_headers(request: Request) -> dict[str, str]:
    return {k.lower(): v for k, v in request.headers.items()}


class Call:
    """One request's bookkeeping: id, timing, labels, and the single access-log line at the end."""

    __slots__ = ("protocol", "request_id", "started", "model", "deployment", "backend", "device", "tenant")

    def __init__(self, protocol: Protocol, headers: Mapping[str, str]) -> None:
        self.protocol = protocol
        self.request_id = headers.get("x-request-id") or uuid.uuid4().hex
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
        metrics.REQUESTS.labels(self.protocol, self.model, self.deployment, self.tenant, str(status)).inc()
        if self.model:
            metrics.REQUEST_LATENCY.labels(self.protocol, self.model, self.deployment).observe(elapsed)
        log.info(
            "request",
            request_id=self.request_id,
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
        response.headers["x-request-id"] = self.request_id
        return response
