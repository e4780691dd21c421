"""Errors as gRPC statuses: the same ServingError the HTTP adapters answer, as a status code,
its message, and trailing metadata (retry-after, rate-limit headers, the request id)."""

from __future__ import annotations

from typing import Any, NoReturn

import grpc
import structlog

from fleetgate.errors import describe
from gateway.core.calls import Call

log = structlog.get_logger(__name__)

#: HTTP status of a ServingError -> gRPC status code (the usual mapping; 413 is a message too large)
_CODES: dict[int, grpc.StatusCode] = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    409: grpc.StatusCode.ALREADY_EXISTS,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    415: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def status_code(http_status: int) -> grpc.StatusCode:
    if http_status in _CODES:
        return _CODES[http_status]
    return grpc.StatusCode.INVALID_ARGUMENT if 400 <= http_status < 500 else grpc.StatusCode.INTERNAL


def trailing_metadata(headers: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """Response headers as gRPC metadata (names lower-case, as gRPC requires)."""
    return tuple((k.lower(), v) for k, v in headers.items())


async def abort_with(context: Any, call: Call, exc: BaseException) -> NoReturn:
    """End the RPC with the status of `exc` (INTERNAL, with details only in the log, for a bug)."""
    known = describe(exc)
    if known is None:
        log.exception("unhandled_error", request_id=call.request_id, exc_info=exc)
        call.done(500, "internal_error")
        context.set_trailing_metadata((("x-request-id", call.echo_id),))
        await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the gateway log")
    status, code, message, headers = known
    call.done(status, code)
    context.set_trailing_metadata((*trailing_metadata(headers), ("x-request-id", call.echo_id)))
    await context.abort(status_code(status), message)


def metadata_of(context: Any) -> dict[str, str]:
    """The RPC's metadata as a dict of lower-cased names (binary `-bin` entries are left out)."""
    out: dict[str, str] = {}
    for key, value in context.invocation_metadata() or ():
        if not key.endswith("-bin") and isinstance(value, str):
            out[key.lower()] = value
    return out
