"""The one guard of the admin API, and its attempt limiting.

`ADMIN_GUARD` protects every admin route (keys, usage, canaries, reload, the admin OpenAPI document):
the admin key is read from the environment variable named by `admin.key_env` at each request (so
rotating it needs no restart) and compared in constant time; with the variable unset the admin API
is off and answers 403. `operator_key_presented` is the same check for the probes' operator detail
and /metrics, which also accept the metrics key.

Attempt limiting: a client that keeps presenting wrong admin keys is slowed down.

Each client address may fail `max_failures` times within `window_s`; beyond that, its admin requests
are refused with 429 (and Retry-After) until its oldest failure leaves the window, whatever key it
sends, so the admin key cannot be guessed at the speed of the network. A success does not clear the
failures (an attacker who also holds a valid key learns nothing from it). Kept per process.
"""

from __future__ import annotations

import hmac
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from litestar.connection import ASGIConnection

from fleetgate.errors import GatewayError
from gateway.admin.actor import act_as
from gateway.http.requests import lower_headers
from gateway.wire.credentials import bearer_key

#: addresses remembered at once (oldest forgotten first): a spray of addresses cannot fill memory
_MAX_ADDRESSES = 10_000


class AdminAttempts:
    def __init__(
        self, max_failures: int = 10, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def check(self, address: str) -> None:
        """Raise 429 when `address` has used up its failed attempts in the window."""
        times = self._recent(address)
        if times is not None and len(times) >= self.max_failures:
            retry = max(1.0, times[0] + self.window_s - self._clock())
            error = GatewayError(
                429, "too_many_admin_failures", "too many failed admin key attempts; try again later"
            )
            error.retry_after_s = retry
            raise error

    def failed(self, address: str) -> None:
        times = self._recent(address)
        if times is None:
            times = self._failures[address] = deque()
            if len(self._failures) > _MAX_ADDRESSES:
                self._failures.popitem(last=False)
        times.append(self._clock())
        self._failures.move_to_end(address)

    def _recent(self, address: str) -> deque[float] | None:
        times = self._failures.get(address)
        if times is None:
            return None
        horizon = self._clock() - self.window_s
        while times and times[0] <= horizon:
            times.popleft()
        return times


def _client_address(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    return connection.client.host if connection.client else "unknown"


def _matches(presented: str, env_names: tuple[str, ...]) -> bool:
    """Whether `presented` equals the value of one of these variables (constant time, all compared)."""
    matched = False
    for name in env_names:
        expected = os.environ.get(name, "")
        if expected and hmac.compare_digest(presented.encode(), expected.encode()):
            matched = True
    return matched


def admin_key(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    """The admin key now (read at each request: rotation needs no restart); 403 when the API is off."""
    admin = connection.app.state.core.config.admin
    key = os.environ.get(admin.key_env, "")
    if not key:
        raise GatewayError(403, "admin_disabled", f"the admin API is off: set {admin.key_env} to enable it")
    return key


def verify_admin_key(connection: ASGIConnection[Any, Any, Any, Any], presented: str) -> None:
    """Raise 401/403/429 unless `presented` is the admin key; a wrong key counts as a failed attempt.

    The one check of the admin key: the admin API's guard and the console's sign-in both call it.
    """
    admin_key(connection)
    attempts: AdminAttempts = connection.app.state.admin_attempts
    address = _client_address(connection)
    attempts.check(address)
    if not _matches(presented, (connection.app.state.core.config.admin.key_env,)):
        attempts.failed(address)
        raise GatewayError(401, "invalid_admin_key", "missing or invalid admin key")


async def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _handler: Any) -> None:
    """Litestar guard: the request must carry the admin key (401/403/429 in the plain envelope).
    The admin is then known to the request's changes (their audit entries, gateway/admin/actor.py).
    A coroutine on purpose: Litestar runs a plain function guard in a worker thread, whose context
    variables the handler would never see."""
    presented = bearer_key(lower_headers(connection)) or ""
    verify_admin_key(connection, presented)
    act_as(connection, presented, "api")


ADMIN_GUARD = [admin_guard]


def operator_key_presented(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    """Whether the request carries the admin or the metrics key (probes' detail, /metrics).

    No key at all is simply not an operator; a wrong key counts as a failed admin attempt, and an
    address that has guessed too often is refused (GatewayError 429).
    """
    admin = connection.app.state.core.config.admin
    presented = bearer_key(lower_headers(connection))
    if presented is None:
        return False
    attempts: AdminAttempts = connection.app.state.admin_attempts
    address = _client_address(connection)
    attempts.check(address)
    if _matches(presented, (admin.key_env, admin.metrics_key_env)):
        return True
    attempts.failed(address)
    return False
