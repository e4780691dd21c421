"""The state path's metrics (policies/leases/metrics.py) follow what admission does: admits beyond
the slices in a cut, and store writes waiting for the store, with either strategy."""

from __future__ import annotations

import contextlib

from prometheus_client import REGISTRY

from policies.errors import StoreUnavailable
from policies.leases import LeaseSettings, PartitionSettings
from policies.stores import open_store
from policies.types import Limits
from tests.policies.helpers import ACME, CutStore, admission


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _pending(strategy: str) -> float:
    return _value("fleetgate_state_settles_pending", strategy=strategy)


async def test_partition_admits_and_lease_settles_pending(clock) -> None:  # noqa: ANN001
    store = CutStore(await open_store("memory://"))
    part = PartitionSettings(max_overspend_fraction=0.1, max_seconds=30)
    adm = admission(store, clock, limits=Limits(requests_per_minute=100), leases=LeaseSettings(), partition=part)  # type: ignore[arg-type]
    first = await adm.admit(ACME, "m", 0)
    await adm.reconcile(first, 0)
    partition_before, pending_before = _value("fleetgate_lease_partition_admits_total"), _pending("leases")
    store.cut = True
    with contextlib.suppress(StoreUnavailable):
        for _ in range(200):
            await adm.admit(ACME, "m", 0)
    assert adm.leases is not None and adm.leases.stats["partition"] == 10  # 10 % of 100, beyond the slice
    assert _value("fleetgate_lease_partition_admits_total") - partition_before == 10
    with contextlib.suppress(StoreUnavailable):
        await adm.leases.flush()  # the batch and the slices' give-back wait for the store
    waiting = len(adm.leases.pending)
    assert waiting > 0 and _pending("leases") - pending_before == waiting
    store.cut = False
    await adm.leases.flush()
    assert adm.leases.pending == [] and _pending("leases") == pending_before
    await adm.close()


async def test_per_request_settles_pending(clock) -> None:  # noqa: ANN001
    store = CutStore(await open_store("memory://"))
    adm = admission(store, clock, limits=Limits(requests_per_minute=100), leases=LeaseSettings(strategy="per_request"))  # type: ignore[arg-type]
    before = _pending("per_request")
    r = await adm.admit(ACME, "m", 0)
    store.cut = True
    await adm.reconcile(r, 0)  # deferred: kept for the next call that reaches the store
    assert _pending("per_request") - before == 1
    store.cut = False
    await adm.reconcile(await adm.admit(ACME, "m", 0), 0)  # the store answers: the deferred one is written
    assert _pending("per_request") == before
