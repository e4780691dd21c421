"""Errors in the caller's own protocol envelope, with the right status and headers.

OpenAI clients expect `{"error": {"message", "type", "code"}}`; Open Inference Protocol v2 and
TF Serving REST clients expect `{"error": "..."}`. Any exception that carries `status`, `code` and
`message` (backends' BackendError, policies' PolicyError, the gateway's own GatewayError) maps
directly; anything else is an internal error whose details go to the log, never to the caller.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec
from litestar import Response

Protocol = Literal["openai", "v2", "tfserving", "plain"]

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


class GatewayError(Exception):
    """An error raised by the HTTP edge itself (bad body, too large, wrong content type)."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}
        self.retry_after_s: float | None = None


def describe(exc: BaseException) -> tuple[int, str, str, dict[str, str]] | None:
    """(status, code, message, headers) of a known error, or None for an unexpected one."""
    status = getattr(exc, "status", None)
    message = getattr(exc, "message", None)
    if not isinstance(status, int) or not isinstance(message, str):
        return None
    headers = dict(getattr(exc, "headers", None) or {})
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None and "Retry-After" not in headers:
        headers["Retry-After"] = str(max(1, math.ceil(retry)))
    return status, str(getattr(exc, "code", "error")), message, headers


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
