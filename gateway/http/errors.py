"""Errors in the caller's own protocol envelope, with the right status and headers.

OpenAI clients expect `{"error": {"message", "type", "code"}}`; Open Inference Protocol v2 and
TF Serving REST clients expect `{"error": "..."}`. Every `fleetgate.errors.ServingError`
(backends' BackendError, policies' PolicyError, the gateway's own GatewayError) maps directly;
anything else is an internal error whose details go to the log, never to the caller.
"""

from __future__ import annotations

import msgspec
from litestar import Response

from fleetgate.errors import Protocol, describe

_encoder = msgspec.json.Encoder()

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}




def error_body(protocol: Protocol, status: int, code: str, message: str) -> bytes:
    if protocol == "openai":
        kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return _encoder.encode({"error": {"message": message, "type": kind, "code": code, "param": None}})
    return _encoder.encode({"error": message})


def error_response(
    protocol: Protocol, status: int, code: str, message: str, headers: dict[str, str] | None = None
) -> Response[bytes]:
    return Response(
        content=error_body(protocol, status, code, message),
        status_code=status,
        media_type="application/json",
        headers=headers or {},
    )


def exception_response(protocol: Protocol, exc: BaseException) -> Response[bytes]:
    known = describe(exc)
    if known is None:
        return error_response(protocol, 500, "internal_error", "internal error; see the gateway log")
    status, code, message, headers = known
    return error_response(protocol, status, code, message, headers)
