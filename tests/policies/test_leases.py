"""Leases (policies/leases): replicas splitting one limit exactly, a dead replica's slices given back,
a reload below the slices out, the per-request strategy answering the same, settlement in batches."""

from __future__ import annotations

import asyncio
import random

import pytest

from policies.errors import QuotaExceeded, RateLimited, StoreUnavailable
from policies.leases import LeaseSettings, PartitionSettings
from policies.stores.base import StateStore
from policies.types import Limits, Quotas, TenantSpec
from tests.policies.helpers import ACME, ACME_KEY2, CutStore, admission, admit_until_cut_off

LEASES = LeaseSettings()


async def _one(adm, i: int, cost: int = 0):  # noqa: ANN001, ANN202
    try:
        return await adm.admit(ACME if i % 3 else ACME_KEY2, "m", cost)
    except (RateLimited, QuotaExceeded):
        return None


async def test_two_replicas_split_one_bucket_exactly(replicas, clock) -> None:
    """The issue's case: two replicas, 100 per minute, a 500-request burst: exactly 100 admitted."""
    adms = [admission(await replicas(), clock, limits=Limits(requests_per_minute=100), leases=LEASES) for _ in range(2)]
    results = await asyncio.gather(*(_one(adms[i % 2], i) for i in range(500)))
    admitted = [r for r in results if r is not None]
    assert len(admitted) == 100
    assert sum(a.leases.stats["local"] for a in adms) > 0  # most came from memory, not the store
    for r in admitted:
        await adms[0 if r.id.startswith(adms[0].instance) else 1].reconcile(r, 0)
    for a in adms:
        await a.close()
    rows = {row.period: row.requests for row in await adms[0].usage("acme")}
    assert rows["2026-11-21"] == 100


async def test_tokens_and_quota_hold_across_replicas(replicas, clock) -> None:
    rng = random.Random(7)
    costs = [rng.randint(1, 400) for _ in range(300)]
    limits, quotas = Limits(tokens_per_minute=20_000), Quotas(tokens_per_day=15_000)
    adms = [admission(await replicas(), clock, limits=limits, quotas=quotas, leases=LEASES) for _ in range(2)]
    results = await asyncio.gather(*(_one(adms[i % 2], i, costs[i]) for i in range(300)))
    admitted = [r for r in results if r is not None]
    assert sum(r.cost_tokens for r in admitted) <= 15_000
    assert sum(r.cost_tokens for r in admitted) > 15_000 - 400


async def test_dead_replica_slices_are_given_back(replicas, clock) -> None:
    """A replica dies with slices out (after its last batch): the survivor admits the rest."""
    store_a, store_b = await replicas(), await replicas()
    limits, quotas = Limits(requests_per_minute=50), Quotas(requests_per_day=40)
    a = admission(store_a, clock, limits=limits, quotas=quotas, leases=LEASES)
    b = admission(store_b, clock, limits=limits, quotas=quotas, leases=LEASES)
    await a.heartbeat(10)
    await b.heartbeat(1000)
    taken = [await a.admit(ACME, "m", 0) for _ in range(15)]
    for r in taken:
        await a.reconcile(r, 0)
    await a.leases.flush()  # the batch is written; fresh slices are out for the keys in use
    assert a.leases.book.keys["rl:t:acme:rpm"].left > 0
    a.leases._task.cancel()  # noqa: SLF001 - "kill -9": no more ticks, nothing given back
    clock.advance(11)  # its heartbeat is gone: the recovery window
    limits_now = Limits(requests_per_minute=50)
    assert limits_now
    await b.recover()
    rest = [await _one(b, 1) for _ in range(60)]
    assert sum(r is not None for r in rest) == 40 - 15  # the daily quota's rest, exactly
    for r in rest:
        if r is not None:
            await b.reconcile(r, 0)
    await b.close()
    assert {row.period: row.requests for row in await b.usage("acme")}["2026-11-21"] == 40


async def test_reload_below_the_slices_out(replicas, clock) -> None:
    a = admission(await replicas(), clock, limits=Limits(requests_per_minute=100), leases=LEASES)
    first = [await a.admit(ACME, "m", 0) for _ in range(5)]
    assert a.leases.book.keys["rl:t:acme:rpm"].left > 0  # a slice bigger than what was used
    a.update_tenants({"acme": TenantSpec(limits=Limits(requests_per_minute=8))})
    await a.leases.flush(retake=False)
    more = [await _one(a, 1) for _ in range(20)]
    assert len(first) + sum(r is not None for r in more) == 8


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_same_answers_as_per_request(seed: int, clock) -> None:
    """Differential: one scenario through both strategies, on one replica: the same yes/no,
    Retry-After, message and headers at every step, and the same usage, with ticks running all the
    time; requests use half the tokens they reserved (refunds)."""
    from policies.stores import open_store

    rng = random.Random(seed)
    steps = [(rng.choice([ACME, ACME_KEY2]), rng.randint(0, 300), rng.random() < 0.3) for _ in range(400)]
    limits = Limits(requests_per_minute=60, tokens_per_minute=9_000, max_concurrency=5)
    quotas = Quotas(tokens_per_day=40_000, requests_per_day=300)

    async def run(settings: LeaseSettings) -> list[tuple]:  # noqa: ANN202
        store: StateStore = await open_store("memory://")
        adm = admission(store, clock, limits=limits, quotas=quotas, key_limits=Limits(requests_per_minute=40), leases=settings)
        start, out, open_ = clock.now, [], []
        for principal, cost, ends in steps:
            clock.advance(0.05)
            try:
                r = await adm.admit(principal, "m", cost)
                out.append(("ok", adm.headers(r)))
                open_.append(r)
            except (RateLimited, QuotaExceeded) as exc:
                out.append((type(exc).__name__, round(exc.retry_after_s or 0, 3), str(exc)))
            if ends and open_:
                r = open_.pop(0)
                await adm.reconcile(r, r.cost_tokens // 2)
        for r in open_:
            await adm.reconcile(r, r.cost_tokens // 2)
        await adm.close()
        usage = await adm.usage("acme")
        clock.now = start
        return [*out, [(u.period, u.requests, u.tokens) for u in usage]]

    assert await run(LeaseSettings(flush_s=0.001)) == await run(LeaseSettings(strategy="per_request"))


async def test_batch_settles_once_and_kill_loses_at_most_one_flush(clock) -> None:
    """Settlement off the request: nothing is in the store until the tick; a tick writes the batch."""
    from policies.stores import open_store

    store = await open_store("memory://")
    adm = admission(store, clock, quotas=Quotas(tokens_per_day=10_000), leases=LEASES)
    for _ in range(10):
        r = await adm.admit(ACME, "m", 10)
        await adm.reconcile(r, 7)
    assert await store.usage("acme") == []  # not yet written: the window a kill -9 can lose
    await adm.leases.flush()
    rows = {u.period: (u.requests, u.tokens) for u in await store.usage("acme")}
    assert rows["2026-11-21"] == (10, 70)
    await adm.leases.flush()  # nothing new: nothing applied twice
    assert {u.period: u.requests for u in await store.usage("acme")}["2026-11-21"] == 10


async def test_a_tenant_with_nothing_to_check_records_usage_with_the_batch(clock) -> None:
    """A tenant without limits, quotas or budget is admitted at once and settled at once, in memory:
    its usage goes with the next batch (nothing in the store before the tick, all of it after, once),
    and the process's own usage reads include it at once. The per-request strategy writes each."""
    from policies.stores import open_store

    store = await open_store("memory://")
    adm = admission(store, clock, leases=LEASES)
    for _ in range(5):
        r = adm.admit_at_once(ACME, "m", 10)
        assert r is not None and adm.settles_at_once(r)
        assert adm.reconcile_at_once(r, 7)
        assert adm.reconcile_at_once(r, 7)  # settled once: a second settle changes nothing
    assert await store.usage("acme") == []  # the window a kill -9 can lose
    rows = {u.period: (u.requests, u.tokens) for u in await adm.usage("acme")}  # writes the batch first
    assert rows["2026-11-21"] == (5, 35)
    await adm.leases.flush()
    assert {u.period: u.requests for u in await store.usage("acme")}["2026-11-21"] == 5

    own_store = await open_store("memory://")
    per_request = admission(own_store, clock)
    r = per_request.admit_at_once(ACME, "m", 10)
    assert r is not None and not per_request.settles_at_once(r) and not per_request.reconcile_at_once(r, 7)
    await per_request.reconcile(r, 7)
    assert {u.period: u.requests for u in await own_store.usage("acme")}["2026-11-21"] == 1


async def test_partition_bound_and_exact_reconciliation(clock) -> None:
    from policies.stores import open_store

    inner = await open_store("memory://")
    store = CutStore(inner)
    part = PartitionSettings(max_overspend_fraction=0.1, max_seconds=30)
    adm = admission(store, clock, limits=Limits(requests_per_minute=100), leases=LEASES, partition=part)  # type: ignore[arg-type]
    answered = [await adm.admit(ACME, "m", 0) for _ in range(3)]
    store.cut = True
    during = await admit_until_cut_off(adm)
    held_then = len(during)
    assert 10 <= held_then <= 10 + 10  # the slice held, then at most 10 % of the limit beyond it
    clock.advance(31)
    with pytest.raises(StoreUnavailable):
        await adm.admit(ACME, "m", 0)
    store.cut = False
    for r in answered + during:
        await adm.reconcile(r, 0)
    await adm.close()
    rows = {u.period: u.requests for u in await inner.usage("acme")}
    assert rows["2026-11-21"] == len(answered) + held_then  # recorded usage equals answered requests


async def test_refunds_go_back_to_the_slice_held(clock) -> None:
    """Tokens reserved and not used are admitted again from memory at once, not after the batch."""
    from policies.stores import open_store

    adm = admission(await open_store("memory://"), clock, limits=Limits(tokens_per_minute=1_000), leases=LEASES)
    r = await adm.admit(ACME, "m", 100)
    left = adm.leases.book.keys["rl:t:acme:tpm"].left
    await adm.reconcile(r, 40)
    assert adm.leases.book.keys["rl:t:acme:tpm"].left == left + 60
    await adm.close()
    store_level = adm.leases.book.keys["rl:t:acme:tpm"]
    assert store_level.left == 0


async def test_concurrency_shares_hold_across_replicas(replicas, clock) -> None:
    """Slots held by each replica are counted by the store: 7 in flight across both, never more;
    slots freed by finished requests are reused, idle ones go back for the other replica."""
    adms = [admission(await replicas(), clock, limits=Limits(max_concurrency=7), leases=LEASES) for _ in range(2)]
    results = await asyncio.gather(*(_one(adms[i % 2], i) for i in range(60)))
    admitted = [r for r in results if r is not None]
    assert len(admitted) == 7
    for r in admitted:
        await adms[0 if r.id.startswith(adms[0].instance) else 1].reconcile(r, 0)
    results = await asyncio.gather(*(_one(adms[0], i) for i in range(60)))  # held by replica 0 now
    assert sum(r is not None for r in results) == 7 - sum(len(p.held) for p in adms[1].leases.slots.values())
    for a in adms:
        await a.close()  # replica 1's idle slots go back
    assert sum(len(p.held) for p in adms[1].leases.slots.values()) == 0


class _GatedStore:
    """A store whose acquires wait for `gate` while it is set (a store answering slowly)."""

    def __init__(self, inner: StateStore) -> None:
        self.inner, self.gate = inner, None

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    async def acquire(self, **kwargs):  # noqa: ANN003, ANN201
        if self.gate is not None:
            await self.gate.wait()
        return await self.inner.acquire(**kwargs)


async def test_a_top_up_in_flight_keeps_the_units_it_counted_on(clock) -> None:
    """While a top-up waits for the store, a request admitted from memory cannot spend the units the
    top-up counted on: a 100-token day never admits more than 100 tokens."""
    from policies.stores import open_store

    store = _GatedStore(await open_store("memory://"))
    adm = admission(store, clock, quotas=Quotas(tokens_per_day=100), leases=LEASES)  # type: ignore[arg-type]
    first = await adm.admit(ACME, "m", 60)
    await adm.reconcile(first, 20)  # 40 unused tokens go back into the slice held here
    assert adm.leases.book.keys["q:acme:tokens:d:2026-11-21"].left == 40
    store.gate = asyncio.Event()
    topping = asyncio.ensure_future(adm.admit(ACME, "m", 50))  # lacks 10: a top-up, waiting on the store
    await asyncio.sleep(0)
    assert adm.admit_at_once(ACME, "m", 40) is None  # the 40 held are the top-up's now
    store.gate.set()
    second = await topping
    with pytest.raises(QuotaExceeded):  # 20 used + 50 reserved: 30 left, too few for 40
        await adm.admit(ACME, "m", 40)
    await adm.reconcile(second, 50)
    await adm.close()
    assert adm.leases.book.keys["q:acme:tokens:d:2026-11-21"].left == 0


async def test_a_top_up_holds_at_most_max_share(clock) -> None:
    """What a top-up sets aside counts as held when it sizes the slice: the process holds at most
    `max_share` of the limit after it (100 of 1,000), as it would have without the set-aside."""
    from policies.stores import open_store

    adm = admission(await open_store("memory://"), clock, quotas=Quotas(tokens_per_day=1_000), leases=LEASES)
    first = await adm.admit(ACME, "m", 60)
    await adm.reconcile(first, 20)  # 40 held
    await adm.admit(ACME, "m", 50)  # lacks 10: a top-up to a slice of 100
    assert adm.leases.book.keys["q:acme:tokens:d:2026-11-21"].left == 100 - 50
    await adm.close()


async def test_a_cancelled_top_up_frees_the_slot_it_took(clock) -> None:
    """A request whose top-up is cancelled (its client went away) leaves the concurrency slot it had
    taken from those held free for the next one."""
    from policies.stores import open_store

    store = _GatedStore(await open_store("memory://"))
    adm = admission(store, clock, limits=Limits(requests_per_minute=100, max_concurrency=2), leases=LEASES)  # type: ignore[arg-type]
    await adm.reconcile(await adm.admit(ACME, "m", 0), 0)  # a slot held, free; the bucket's slice spent
    pool = next(iter(adm.leases.slots.values()))
    assert (len(pool.held), pool.busy) == (1, 0)
    store.gate = asyncio.Event()
    waiting = asyncio.ensure_future(adm.admit(ACME, "m", 0))  # takes the held slot, tops up the bucket
    await asyncio.sleep(0)
    assert pool.busy == 1
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert pool.busy == 0
    store.gate = None
    await adm.close()


class _RefusesBatches(CutStore):
    """A store that answers but refuses every ledger batch (usage or charges) with an error of its own
    (a defect in one write, not an outage) while `refusing`; and fails every call while `cut`."""

    def __init__(self, inner: StateStore) -> None:
        super().__init__(inner)
        self.refusing = True

    async def settle_many(self, settles, *, urgent: bool = False):  # noqa: ANN001, ANN201
        if self.cut:
            raise StoreUnavailable("cut")
        if not self.refusing:
            return await self.inner.settle_many(settles, urgent=urgent)
        answers = []
        for s in settles:
            if s["usage"] or any(op.cost > 0 for op in s["buckets"] + s["counters"]):  # a ledger batch
                answers.append(ValueError("a defect in this write"))
            else:
                answers.append((await self.inner.settle_many([s], urgent=urgent))[0])
        return answers


async def test_a_settle_refused_for_a_defect_is_retried_without_taking_the_path_down(clock) -> None:
    """A settle that fails with an error other than an outage's stays pending and is tried again at
    each tick, but the store still answers: the path is not taken for cut off (with partition
    tolerance on, that would admit from the bound alone and refuse after `max_seconds`), and once the
    write succeeds the recorded usage equals the answered requests."""
    from policies.stores import open_store

    inner = await open_store("memory://")
    store = _RefusesBatches(inner)
    part = PartitionSettings(max_overspend_fraction=0.1, max_seconds=30)
    adm = admission(store, clock, limits=Limits(requests_per_minute=1000), leases=LEASES, partition=part)  # type: ignore[arg-type]
    answered = 0
    for _ in range(3):
        for _ in range(150):  # more than one slice's worth a round: each round takes a top-up
            await adm.reconcile(await adm.admit(ACME, "m", 0), 0)
            answered += 1
        await adm.leases.flush()
        assert adm.leases.down_since is None and adm.leases.pending  # not cut off; the batch waits
        clock.advance(20)
    assert adm.leases.stats["partition"] == 0  # nothing was admitted as if cut off
    store.refusing = False
    await adm.leases.flush()
    assert not adm.leases.pending
    await adm.close()
    rows = {u.period: u.requests for u in await inner.usage("acme")}
    assert rows["2026-11-21"] == answered


async def test_an_outages_charges_stay_counted_while_their_batch_is_refused(clock) -> None:
    """What a cut-off gateway admitted beyond its slices is charged with the next batch: while that
    batch is refused (a defect), the overspend stays counted against the partition bound, so a
    second outage cannot add a second bound's worth."""
    from policies.stores import open_store

    inner = await open_store("memory://")
    store = _RefusesBatches(inner)
    store.refusing = False
    part = PartitionSettings(max_overspend_fraction=0.1, max_seconds=30)
    adm = admission(store, clock, limits=Limits(requests_per_minute=100), leases=LEASES, partition=part)  # type: ignore[arg-type]

    answered = [await adm.admit(ACME, "m", 0) for _ in range(3)]
    store.cut = True
    answered += await admit_until_cut_off(adm)
    overspent = sum(adm.leases.overspent.values())
    assert overspent == 10  # 10 % of the limit beyond the slice held
    store.cut, store.refusing = False, True
    await adm.leases.flush()  # the store answers, but refuses the batch that carries the charges
    assert adm.leases.down_since is None and sum(adm.leases.overspent.values()) == overspent
    store.cut = True
    beyond_before = adm.leases.stats["partition"]
    answered += await admit_until_cut_off(adm)
    assert adm.leases.stats["partition"] == beyond_before  # the bound was spent by the first outage
    store.cut, store.refusing = False, False
    for r in answered:
        await adm.reconcile(r, 0)
    await adm.close()
    assert not adm.leases.overspent
    assert {u.period: u.requests for u in await inner.usage("acme")}["2026-11-21"] == len(answered)
