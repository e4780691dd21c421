"""The bytes each tenant stores as batch files, counted in the state store against `max_tenant_bytes`.

One counter per tenant (`files:bytes:<tenant>`), changed only by the store's atomic steps, so
replicas sharing a store share the count. An upload reserves its bytes with a check against the
quota (refused: nothing is added) and a journal entry under this process's name: should the process
die before the upload is stored, `Admission.recover` gives the reservation back like any request's.
`confirm` ends the reservation (the bytes stay counted); deleting a file frees its bytes. A job's
output and error files are counted too, never refused (a job's results are not lost to a quota): a
tenant whose outputs fill the quota deletes files before uploading more.
"""

from __future__ import annotations

import os

from fleetgate.errors import GatewayError
from policies.stores.base import CounterOp, Journal, StateStore

#: a counter the store keeps (about a century): stored bytes belong to no period
_KEEP_S = 100 * 365 * 86400.0


def counter_key(tenant: str) -> str:
    return f"files:bytes:{tenant}"


class StoredBytes:
    """Per-tenant stored bytes of one state store, for one gateway process (`instance`)."""

    def __init__(self, store: StateStore, instance: str, quota: int) -> None:
        self._store = store
        self._instance = instance
        self.quota = quota

    def _op(self, tenant: str, cost: int, now: float, limit: int | None) -> CounterOp:
        return CounterOp(counter_key(tenant), limit, cost, now + _KEEP_S)

    async def used(self, tenant: str, now: float) -> int:
        result = await self._store.acquire(
            lease_id=f"{self._instance}.read", lease_ttl_s=1.0, buckets=[], leases=[],
            counters=[self._op(tenant, 0, now, None)], now=now,
        )  # fmt: skip
        return result.counters[0] if result.counters else 0

    async def reserve(
        self, tenant: str, size: int, now: float, whole: int | None = None, at_least: bool = False
    ) -> str:
        """Reserve `size` more bytes for an upload of `whole` bytes (default `size`; with `at_least`,
        of `whole` bytes or more, as a declared length says); its reservation id (for `confirm` and
        `release`).

        Raises:
            GatewayError: 413 when `size` alone is over the quota, 429 when the tenant's files leave
                too little room (both name the quota; the 429 says what is used).
        """
        whole = size if whole is None else whole
        described = f"at least {whole}" if at_least else str(whole)
        if whole > self.quota:
            raise GatewayError(
                413, "storage_quota_exceeded",
                f"a file of {described} bytes can never fit the tenant's storage quota of {self.quota} bytes "
                "(batches.max_tenant_bytes)",
            )  # fmt: skip
        lease_id = f"{self._instance}.files.{os.urandom(6).hex()}"
        op = self._op(tenant, size, now, self.quota)
        journal = Journal(self._instance, [], [op])
        result = await self._store.acquire(
            lease_id=lease_id, lease_ttl_s=1.0, buckets=[], leases=[], counters=[op], now=now, journal=journal
        )
        if not result.ok:
            used = result.counters[0] if result.counters else 0
            raise GatewayError(
                429, "storage_quota_exceeded",
                f"storing a file of {described} bytes would pass the tenant's storage quota of {self.quota} bytes "
                f"(batches.max_tenant_bytes): {used} bytes are in use; delete files to free room",
            )  # fmt: skip
        return lease_id

    async def confirm(self, lease_id: str, tenant: str, adjust: int, now: float) -> None:
        """End a reservation: its bytes stay counted, corrected by `adjust` (the file's real size less
        what was reserved, <= 0)."""
        counters = [self._op(tenant, adjust, now, None)] if adjust else []
        await self._store.settle(
            settle_id=lease_id, lease_id=lease_id, buckets=[], release=[], counters=counters, usage=[], now=now
        )

    async def release(self, lease_id: str, tenant: str, size: int, now: float) -> None:
        """Give a reservation back whole (the upload was refused or failed)."""
        await self.confirm(lease_id, tenant, -size, now)

    async def add(self, tenant: str, delta: int, now: float) -> None:
        """Count (or, negative, free) bytes at once, never refused: a job's files, a deleted file."""
        if delta:
            await self._store.settle(
                settle_id=f"{self._instance}.files.{os.urandom(6).hex()}", lease_id="", buckets=[],
                release=[], counters=[self._op(tenant, delta, now, None)], usage=[], now=now,
            )  # fmt: skip
