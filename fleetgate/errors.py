"""The base of every error a caller may see, whichever layer raises it.

Backends (`BackendError`), policies (`PolicyError`) and the gateway's own edge (`GatewayError`)
raise subclasses; `gateway/http/errors.py` maps any of them to the caller's protocol envelope (HTTP
status and body; the gRPC front ends map the same fields to status codes). Anything that is not a
`ServingError` is an internal error: its details go to the log, never to the caller.
"""

from __future__ import annotations

import math
from typing import Literal

#: the protocol a call arrived in: its error envelope, and the `protocol` label of metrics and logs
Protocol = Literal["openai", "v2", "tfserving", "plain", "v2-grpc", "tfserving-grpc"]


class ServingError(Exception):
    """A refusal or failure with a status, a machine code and a message that is safe to show.

    Attributes:
        status: the HTTP status the gateway answers with (protocols map it to their own codes).
        code: a short machine-readable code.
        message: what the caller sees; never a secret, a path or a driver's error text.
        retry_after_s: when the caller may try again, if known (becomes `Retry-After`).
        headers: extra response headers (`x-ratelimit-*`, `Retry-After`).
    """

    status: int = 500
    code: str = "error"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.headers: dict[str, str] = dict(headers or {})

    def response_headers(self) -> dict[str, str]:
        """`headers` plus `Retry-After` when a retry delay is known and no header says it yet."""
        out = dict(self.headers)
        if self.retry_after_s is not None and "Retry-After" not in out:
            out["Retry-After"] = retry_after_header(self.retry_after_s)
        return out


def retry_after_header(seconds: float) -> str:
    """`Retry-After` in whole seconds (RFC 9110), rounded up and never 0, or clients would hammer."""
    return str(max(1, math.ceil(seconds)))


class GatewayError(ServingError):
    """An error raised by the gateway itself (bad body, too large, wrong content type, admin key)."""

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message, headers=headers)
        self.status = status
        self.code = code


def describe(exc: BaseException) -> tuple[int, str, str, dict[str, str]] | None:
    """(status, code, message, headers) of a `ServingError`, or None for an unexpected one."""
    if not isinstance(exc, ServingError):
        return None
    return exc.status, exc.code, exc.message, exc.response_headers()
