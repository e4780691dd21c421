"""Errors of the policy layer; the gateway turns each into the caller's protocol envelope.

Every error carries the HTTP status, a short machine code, a message that is safe to show (it never
contains a secret), an optional retry delay and the headers the answer must carry (`Retry-After`,
`x-ratelimit-*`).
"""

from __future__ import annotations

import math

from fleetgate.errors import ServingError, retry_after_header


class PolicyError(ServingError):
    """Base class: a refusal with a status, a code, a safe message and response headers."""

    status: int = 500
    code: str = "policy_error"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s, headers=headers)
        if retry_after_s is not None:
            self.headers.setdefault("Retry-After", retry_after_header(retry_after_s))
            self.headers.setdefault("retry-after-ms", str(max(1, math.ceil(retry_after_s * 1000))))


class Unauthenticated(PolicyError):
    """No API key, or a key that is malformed, unknown, revoked or expired."""

    status = 401
    code = "invalid_api_key"


class RateLimited(PolicyError):
    """A requests/tokens per minute or concurrency limit refuses the request now."""

    status = 429
    code = "rate_limit_exceeded"


class NeverAdmitted(PolicyError):
    """A request larger than a limit or quota can ever hold (tokens per minute, a day's tokens):
    waiting would not help, so it is a 400 without `Retry-After`; the message names the limit."""

    status = 400
    code = "request_exceeds_limit"


class QuotaExceeded(PolicyError):
    """A day or month budget is spent; the message names the quota and when it resets."""

    status = 429
    code = "quota_exceeded"


class BudgetExceeded(QuotaExceeded):
    """A tenant's or key's budget in USD cannot take the request's worst-case cost; the message
    names the budget, what is left and when it resets."""

    code = "budget_exceeded"


class StoreUnavailable(PolicyError):
    """The state store cannot be reached, so limits cannot be enforced (fail closed).

    `message` is what clients see (no file paths, hosts or driver errors); `detail` says where and
    why, for the operator's log and the CLI.
    """

    status = 503
    code = "state_store_unavailable"

    def __init__(self, detail: str, *, retry_after_s: float | None = 1.0) -> None:
        super().__init__("the state store is unavailable; try again shortly", retry_after_s=retry_after_s)
        self.detail = detail
