"""Leases across config changes and restarts: a key edited leaves other keys' slices alone, a reload
during a top-up admits nothing twice, a restart under the same instance name loses no batch, and a
tick's settles each give back their own slice's share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec

from policies.admission import Admission
from policies.admission.shapes import Shapes
from policies.leases import LeaseSettings
from policies.leases.slices import Grant, SliceBook
from policies.principal import Principal
from policies.stores.base import BucketOp
from policies.stores.memory import MemoryStore
from policies.types import Limits, TenantSpec
from tests.policies.helpers import ACME, what_another_replica_takes

#: ticks only when a test asks (`leases.flush()`)
QUIET = LeaseSettings(max_share=1.0, flush_s=1000)


async def test_a_key_edited_leaves_other_tenants_slices_alone(clock) -> None:
    tenants = {"acme": TenantSpec(), "beta": TenantSpec(limits=Limits(requests_per_minute=10))}
    adm = Admission(MemoryStore(), tenants, clock, leases=QUIET)
    beta = Principal("beta", "bbbbbbbbbbbb")
    await adm.admit(beta, "m", 0)
    await adm.leases.flush()  # beta holds a slice of the rest of its minute
    await adm.admit(beta, "m", 0)
    held = adm.leases.book.keys["rl:t:beta:rpm"].left
    assert held > 0
    key = Principal("acme", "aaaaaaaaaaaa", limits=Limits(requests_per_minute=5))
    await adm.admit(key, "m", 0)
    await adm.admit(msgspec.structs.replace(key, limits=Limits(requests_per_minute=6)), "m", 0)  # edited
    assert adm.leases.book.keys["rl:t:beta:rpm"].left == held
    for _ in range(8):  # 2 of beta's 10 used: 8 more, from its slice, not refused as if taken
        await adm.admit(beta, "m", 0)
    await adm.close()


class _CallDuringAcquire(MemoryStore):
    """A memory store that runs `during` once, inside the next acquire, before answering it."""

    during: Callable[[], None] | None = None

    async def acquire(self, **kwargs):  # noqa: ANN003, ANN201
        if self.during is not None:
            during, self.during = self.during, None
            await asyncio.sleep(0)
            during()
        return await super().acquire(**kwargs)


async def test_a_reload_during_a_top_up_admits_no_token_twice(clock) -> None:
    store = _CallDuringAcquire()
    tenants = {"acme": TenantSpec(limits=Limits(tokens_per_minute=1000))}
    adm = Admission(store, tenants, clock, leases=LeaseSettings(max_share=0.3, flush_s=1000))
    admitted = 10
    await adm.reconcile(await adm.admit(ACME, "m", 10), 10)
    await adm.leases.flush()  # a slice of the tenant's tokens per minute, held
    need = int(adm.leases.book.keys["rl:t:acme:tpm"].left) + 5  # more than held: a top-up
    store.during = lambda: adm.update_tenants(dict(tenants))  # a reload while its acquire is out
    await adm.reconcile(await adm.admit(ACME, "m", need), need)
    admitted += need
    await adm.leases.flush(retake=False)
    admitted += await what_another_replica_takes(store, tenants, clock, tokens=1)
    assert admitted == 1000
    await adm.close()


async def test_a_restart_under_the_same_instance_name_loses_no_batch(clock) -> None:
    store = MemoryStore()
    for _ in range(2):  # the same process name, started again
        spec = {"acme": TenantSpec(limits=Limits(requests_per_minute=100))}
        adm = Admission(store, spec, clock, instance="edge-1", leases=QUIET)
        await adm.reconcile(await adm.admit(ACME, "m", 5), 5)
        await adm.close()  # its one batch written
    assert sorted((r.period, r.requests, r.tokens) for r in await store.usage("acme")) == [
        ("2026-11", 2, 10),
        ("2026-11-21", 2, 10),
    ]


def test_each_settle_gives_back_its_own_slices_share() -> None:
    """Units admitted count against the oldest slice first: should one settle of a tick be applied and
    the process then die, the crash recovery of the others' journals gives back no unit twice."""
    book = SliceBook(slice_s=1.0, max_share=1.0)
    rpm = BucketOp("rl:a:rpm", 1000.0, 1000 / 60, 0.0)
    old, new = Grant("old"), Grant("new")
    old.buckets[rpm.key] = BucketOp(rpm.key, 1000.0, 1000 / 60, 100.0)
    new.buckets[rpm.key] = BucketOp(rpm.key, 1000.0, 1000 / 60, 1.0)
    book.add(old, rpm.key, 100.0, 1000.0, 0.0)
    book.add(new, rpm.key, 1.0, 1000.0, 0.0)
    book.consume(rpm.key, 50.0, 0.0)
    book.refund(rpm.key, 3.0, rpm)  # a request's unused units, back into the slices held
    book.take_all()
    assert (old.back, new.back) == ({rpm.key: 50.0}, {rpm.key: 4.0})  # 1 of its own and the refund's 3


def test_a_batch_line_and_a_request_of_one_key_keep_their_own_checks(clock) -> None:
    spec = TenantSpec(limits=Limits(requests_per_minute=5))
    shapes = Shapes()
    batch_line = msgspec.structs.replace(ACME, background=object())
    assert shapes.of(batch_line, spec, clock()).checks(1).buckets == []  # quotas only
    assert [b.op.key for b in shapes.of(ACME, spec, clock()).checks(1).buckets] == ["rl:t:acme:rpm"]
