"""A tenant with nothing to check is admitted at once, without a store round trip (`admit_at_once`)."""

from __future__ import annotations

import pytest

from policies.errors import StoreUnavailable, Unauthenticated
from policies.principal import Principal
from policies.stores import open_store
from policies.types import Limits, Quotas
from tests.policies.helpers import ACME, admission


async def test_an_unlimited_tenant_is_admitted_at_once_and_its_usage_recorded(store, clock) -> None:
    gate = admission(store, clock)
    reservation = gate.admit_at_once(ACME, "m", 7)
    assert reservation is not None and reservation.tenant == "acme" and reservation.cost_tokens == 7
    assert (reservation.lease_keys, reservation.headers, reservation.degraded) == ([], {}, False)
    assert gate.stats["admitted"] == 1
    assert (await gate.admit(ACME, "m", 7)).id != reservation.id  # `admit` takes the same path
    await gate.reconcile(reservation, 12)
    rows = [r for r in await store.usage("acme") if len(r.period) == 10]
    assert [(r.model, r.requests, r.tokens) for r in rows] == [("m", 1, 12)]


def test_empty_limit_sections_count_as_nothing_to_check(clock) -> None:
    from policies.stores.memory import MemoryStore

    gate = admission(MemoryStore(), clock, limits=Limits(), key_limits=Limits(), quotas=Quotas())
    assert gate.admit_at_once(ACME, "m", 1) is not None


async def test_it_needs_no_store(tmp_path, clock) -> None:
    store = await open_store(f"sqlite:///{tmp_path / 'state.db'}")
    await store.close()  # every store call now fails
    assert admission(store, clock).admit_at_once(ACME, "m", 1) is not None
    with pytest.raises(StoreUnavailable):  # a tenant with a quota needs it
        await admission(store, clock, quotas=Quotas(requests_per_day=5)).admit(ACME, "m", 1)


@pytest.mark.parametrize(
    "configured",
    [
        {"limits": Limits(requests_per_minute=10)},
        {"limits": Limits(max_concurrency=1)},
        {"key_limits": Limits(tokens_per_minute=100)},
        {"quotas": Quotas(tokens_per_month=1000)},
    ],
)
async def test_any_limit_or_quota_goes_through_the_store(store, clock, configured) -> None:
    gate = admission(store, clock, **configured)
    assert gate.admit_at_once(ACME, "m", 1) is None
    await gate.reconcile(await gate.admit(ACME, "m", 1), 1)


def test_it_refuses_as_admit_does(clock) -> None:
    from policies.stores.memory import MemoryStore

    gate = admission(MemoryStore(), clock)
    with pytest.raises(Unauthenticated, match="no longer configured"):
        gate.admit_at_once(Principal("gone", "0123456789ab", ("*",)), "m", 1)
    with pytest.raises(ValueError, match="cost_tokens"):
        gate.admit_at_once(ACME, "m", -1)


def test_a_reload_that_adds_or_removes_a_limit_changes_the_path(clock) -> None:
    from policies.stores.memory import MemoryStore
    from policies.types import TenantSpec

    gate = admission(MemoryStore(), clock)
    assert gate.admit_at_once(ACME, "m", 1) is not None
    gate.update_tenants({"acme": TenantSpec(limits=Limits(requests_per_minute=5))})
    assert gate.admit_at_once(ACME, "m", 1) is None  # now it has a limit to check
    gate.update_tenants({"acme": TenantSpec()})
    assert gate.admit_at_once(ACME, "m", 1) is not None


async def test_reservation_ids_never_repeat_across_restarts_of_one_instance_name(clock) -> None:
    """A reservation id is the store's settle id: one that came back after a restart would have its
    settle taken for one already applied, and the request's usage lost."""
    from policies.stores.memory import MemoryStore

    store = MemoryStore()
    before = admission(store, clock, instance="edge-1")
    after = admission(store, clock, instance="edge-1")  # the same process name, started again
    first = [(await before.admit(ACME, "m", 1)).id for _ in range(3)]
    second = [(await after.admit(ACME, "m", 1)).id for _ in range(3)]
    assert len(set(first + second)) == 6 and all(i.startswith("edge-1.") for i in first + second)
    for gate, ids in ((before, first), (after, second)):
        for _ in ids:
            await gate.reconcile(await gate.admit(ACME, "m", 1), 1)
    rows = [r for r in await store.usage("acme") if len(r.period) == 10]
    assert rows[0].requests == 6
