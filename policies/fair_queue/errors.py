"""Errors of the fair queue; the gateway turns each into the caller's protocol envelope.

They subclass the policy layer's `PolicyError` (status, code, message, retry_after_s, headers),
so the gateway handles every policy refusal the same way.
"""

from __future__ import annotations

from policies.errors import PolicyError


class QueueError(PolicyError):
    """Base class: a queue rejection with an HTTP status and a code safe to show to the caller.

    Attributes:
        status: HTTP status the gateway answers with.
        code: short machine-readable code.
        message: human-readable text (never contains secrets).
        retry_after_s: when the caller may retry, in seconds, or None.
        headers: extra HTTP headers (`Retry-After` when retry_after_s is set).
    """

    status: int = 503
    code: str = "queue_error"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        # PolicyError adds `Retry-After` (whole seconds, rounded up) when retry_after_s is set.
        super().__init__(message, retry_after_s=retry_after_s)
        if status is not None:
            self.status = status
        if code is not None:
            self.code = code


class QueueFull(QueueError):
    """No room to queue: 429 `tenant_queue_full` (the tenant's own queue) or 503 `queue_full`."""

    status = 503
    code = "queue_full"

    @classmethod
    def tenant(cls, tenant: str, limit: int, retry_after_s: float) -> QueueFull:
        return cls(
            f"tenant {tenant!r} already has {limit} requests queued for this deployment",
            status=429,
            code="tenant_queue_full",
            retry_after_s=retry_after_s,
        )

    @classmethod
    def deployment(cls, limit: int, retry_after_s: float) -> QueueFull:
        return cls(
            f"deployment queue is full ({limit} requests waiting)",
            status=503,
            code="queue_full",
            retry_after_s=retry_after_s,
        )


class QueueDeadlineExceeded(QueueError):
    """The request's deadline passed while it waited; it never reached the backend (504)."""

    status = 504
    code = "queue_deadline_exceeded"
