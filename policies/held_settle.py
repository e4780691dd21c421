"""A settlement held back for its caller to commit together with a record of its own.

Batch jobs (gateway/batches) run each line through the normal request path. Where an interactive
request is settled (usage recorded, unused quota refunded) as soon as it ends, a batch line's
settlement is handed to a `HeldSettle` instead, and the batch runner writes it in the same atomic
store step as the line's "done" mark: a line is on the tenant's bill if and only if it is done.
"""

from __future__ import annotations

import asyncio
from typing import Any


class HeldSettle:
    """The settlement of one background request, filled in by `Admission` and committed by its owner.

    Attributes:
        reserved: `admit` granted a reservation (so a settlement will come).
        settle: the store settle's arguments once `reconcile` ran (None before).
        late: the settle that charges the request's whole cost, should a reclaim have refunded its
            reservation first (see `Admission.commit`).
    """

    __slots__ = ("reserved", "settle", "late", "_done")

    def __init__(self) -> None:
        self.reserved = False
        self.settle: dict[str, Any] | None = None
        self.late: dict[str, Any] | None = None
        self._done = asyncio.Event()

    def hold(self, settle: dict[str, Any], late: dict[str, Any]) -> None:
        """Keep the settlement (called by `Admission.reconcile`, once)."""
        self.settle, self.late = settle, late
        self._done.set()

    async def wait(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        """(settle, late) once the request has been reconciled; (None, None) when it was never admitted."""
        if not self.reserved:
            return None, None
        await self._done.wait()
        return self.settle, self.late
