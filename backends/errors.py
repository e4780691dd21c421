"""Errors a backend raises; the gateway turns each into the caller's protocol envelope.

Every error carries the HTTP status the gateway should answer with and a short machine code.
Backends never build HTTP responses themselves.
"""

from __future__ import annotations

from fleetgate.errors import ServingError


class BackendError(ServingError):
    """Base class: a failure with a status and a code that is safe to show to the caller."""

    status: int = 500
    code: str = "backend_error"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message, retry_after_s=retry_after_s)


class InvalidInput(BackendError):
    """The request does not match the model (shape, datatype, element count, unknown input)."""

    status = 400
    code = "invalid_input"


class ModelNotFound(BackendError):
    """The model, version or label does not exist (or the caller may not see it)."""

    status = 404
    code = "model_not_found"


class BackendUnavailable(BackendError):
    """The backend cannot serve now (not loaded, upstream down, queue full). Fallbacks may retry."""

    status = 503
    code = "unavailable"


class BackendTimeout(BackendError):
    """The backend did not answer within the deadline."""

    status = 504
    code = "timeout"


class BackendInternalError(BackendError):
    """The runtime failed on a request that passed validation; the message is sanitized."""

    status = 500
    code = "internal_error"
