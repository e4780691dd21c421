"""Load-aware choice: expected wait per deployment from its queue and its recent service time.

The expected time until a new request would be finished on a deployment is

    (queued + in flight + 1) x service time / concurrency slots

where the service time is an exponentially weighted moving average (EWMA) of the time the backend
took per request (queue wait excluded) and the slots are the deployment's fair-queue concurrency.
The `+ 1` counts the new request itself, so among idle deployments the faster one wins; dividing by
the slots lets a wide GPU replica with a few requests in flight still beat a narrow idle CPU one
when it really is sooner. A deployment that has served nothing yet is assumed fast (a 1 ms
prior): it is tried early, which is how a fresh replica gets its first samples, and its queue still
counts, so a burst at start-up spreads instead of piling onto one replica.
"""

from __future__ import annotations


class ServiceTimes:
    """EWMA of service time per deployment.

    Only the event loop calls `observe` (the gateway records every attempt there, after awaiting
    the backend), so the estimate needs no lock; do not feed it from runtime threads.

    Args:
        alpha: weight of the newest sample (0 < alpha <= 1); 0.2 follows a change within ~10 requests.
    """

    def __init__(self, alpha: float = 0.2) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self._ewma: dict[str, float] = {}

    def observe(self, deployment: str, seconds: float) -> None:
        """Fold one request's service time into the deployment's estimate (event loop only)."""
        old = self._ewma.get(deployment)
        self._ewma[deployment] = seconds if old is None else old + self.alpha * (seconds - old)

    def get(self, deployment: str) -> float | None:
        """The current estimate in seconds, or None before the first sample."""
        return self._ewma.get(deployment)


#: service time assumed for a deployment without samples yet
PRIOR_SERVICE_S = 0.001


def expected_wait(queued: int, in_flight: int, slots: int, service_s: float | None) -> float:
    """Seconds until a new request would be done (see the module docstring)."""
    if service_s is None:
        service_s = PRIOR_SERVICE_S
    return (queued + in_flight + 1) * service_s / max(1, slots)
