"""The admit step: limits, quotas and leases for one call's cost, safe against cancellation."""

from __future__ import annotations

import asyncio

from fleetgate import tracing
from gateway.core.money.prices import Prices
from gateway.core.streams import StreamSettlement
from gateway.observe import metrics
from policies.admission import Admission, Reservation
from policies.errors import PolicyError
from policies.principal import Principal


class Admitter:
    """Admits a call's cost; a reservation whose caller went away is settled, never leaked."""

    def __init__(self, admission: Admission, settlement: StreamSettlement) -> None:
        self._admission = admission
        self._settlement = settlement

    @property
    def prices(self) -> Prices:
        """The prices the call's worst case and real cost are taken at."""
        return self._settlement.prices

    async def admit(self, principal: Principal, model: str, cost: int, cost_micros: int = 0) -> Reservation:
        """Admit in a task of its own: a caller cancelled meanwhile (deadline, disconnect) cannot
        leave a reservation the store granted without anyone to settle it. A tenant with nothing
        to check is admitted at once, without the task: there is no round trip to guard.
        `cost_micros` is the call's worst-case cost in micro-USD, reserved on its budgets.

        Raises:
            PolicyError: a limit or quota refused (counted in the rejections metric).
        """
        try:
            with tracing.step("admit", **{"fleetgate.cost": cost}):
                granted = self._admission.admit_at_once(principal, model, cost, cost_micros)
                if granted is not None:
                    return granted
                task = asyncio.ensure_future(self._admission.admit(principal, model, cost, cost_micros))
                try:
                    return await asyncio.shield(task)
                except asyncio.CancelledError:
                    task.add_done_callback(self._settle_abandoned)
                    raise
        except PolicyError as exc:
            metrics.REJECTIONS.labels(principal.tenant, exc.code).inc()
            raise

    def _settle_abandoned(self, task: asyncio.Future[Reservation]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        reconcile = self._admission.reconcile(task.result(), 0, failed=True)
        self._settlement.hold(asyncio.ensure_future(reconcile))
