"""`Admission`: check and reserve every limit and quota of a request, settle it when it ends.

`admit` builds one all-or-nothing store acquire (or admits from the lease strategy's slices,
`leased.py`); `reconcile` settles it once and `commit` writes a background request's held
settlement with its marks (`reconciling.py`; the settles themselves are built in `settles.py`, the
errors of a refusal in `refusals.py`); `recover` gives back what dead processes reserved;
`check_stream` renews a long stream's concurrency lease.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Callable, Mapping

import structlog

from policies import ratelimit as rl
from policies.admission import budgeting
from policies.admission import leased as ls
from policies.admission import settles as st
from policies.admission.reconciling import Reconciling
from policies.admission.refusals import refusal
from policies.admission.reservation import Reservation, unchecked_tenants
from policies.admission.shapes import Shape, Shapes
from policies.errors import QuotaExceeded, StoreUnavailable, Unauthenticated
from policies.leases import LeaseSettings, PartitionSettings
from policies.principal import Principal
from policies.stores.base import AcquireResult, CounterOp, Journal, StateStore
from policies.stores.memory import MemoryStore
from policies.types import KeyUsageRow, TenantSpec, UsageRow

log = structlog.get_logger(__name__)

_STATS = ("admitted", "rate_limited", "quota_exceeded", "budget_exceeded", "store_unavailable", "fail_open", "reconcile_deferred")  # fmt: skip


class Admission(Reconciling):
    """Rate limits and quotas of every tenant, on a shared StateStore.

    Args:
        store: shared state (memory, sqlite or redis).
        tenants: tenant name -> spec, from the config.
        clock: epoch seconds now; injected so tests move time.
        fail_open_s: when the store is unreachable, keep admitting for this many seconds against
            this replica's local in-memory state (overspend bounded by one set of limits per replica),
            then fail closed. 0 (default): fail closed at once with StoreUnavailable (503).
        lease_ttl_s: a concurrency slot not released nor renewed within this time is freed (a crashed
            replica cannot leak slots); `check_stream` renews it for long streams.
        budget_thresholds: shares of a budget whose passing is announced to `budget_sink`.
        budget_sink: where budget levels and threshold events go (None: nowhere).
        leases, partition: `state.leases` and `state.partition` (policies/leases); None: per request.
    """

    def __init__(
        self,
        store: StateStore,
        tenants: Mapping[str, TenantSpec],
        clock: Callable[[], float],
        *,
        fail_open_s: float = 0.0,
        lease_ttl_s: float = 300.0,
        instance: str | None = None,
        budget_thresholds: list[float] | None = None,
        budget_sink: budgeting.BudgetSink | None = None,
        leases: LeaseSettings | None = None,
        partition: PartitionSettings | None = None,
    ) -> None:
        #: this process, as its reservations' journals and its heartbeat name it
        self.instance = instance or secrets.token_hex(8)
        # reservation ids: this Admission's own random prefix and a count (unique across processes and
        # restarts, whatever `instance` is; a system call for random bytes on every request was not)
        self._id_prefix = f"{self.instance}.{secrets.token_hex(6)}."
        self._ids = itertools.count()
        self._store = store
        self._tenants = dict(tenants)
        #: tenants with no limit, key limit or quota: admitted at once (`admit_at_once`)
        self._unchecked = unchecked_tenants(self._tenants)
        self._clock = clock
        self._fail_open_s = fail_open_s
        self._lease_ttl_s = lease_ttl_s
        self._local = MemoryStore()  # fail-open state
        self._down_since: float | None = None
        self._pending: list[dict] = []  # settles that failed, retried on the next call that works
        self.budget_watch = budgeting.BudgetWatch(store, budget_thresholds or [], budget_sink, clock)
        #: counters for metrics (`_STATS`)
        self.stats: dict[str, int] = dict.fromkeys(_STATS, 0)
        #: the lease strategy (`leases.strategy: leases`); None: a store acquire and settle per request
        self.leases = ls.lease_path(store, self.instance, clock, leases, partition, lease_ttl_s)
        #: the checks of the keys in use, built once per key, config and day
        self.shapes = Shapes()

    def update_tenants(self, tenants: Mapping[str, TenantSpec]) -> None:
        """Replace the tenant specs (config reload); state in the store carries over."""
        self._tenants = dict(tenants)
        self._unchecked = unchecked_tenants(self._tenants)
        self.shapes.clear()
        if self.leases is not None:
            self.leases.reset()

    async def admit(
        self, principal: Principal, model: str, cost_tokens: int, cost_micros: int = 0
    ) -> Reservation:
        """Check and reserve every limit, quota and budget for one request.

        `cost_micros` is the request's worst-case cost in micro-USD, reserved on its budgets.

        Raises:
            Unauthenticated: the principal's tenant is no longer configured.
            RateLimited: a requests/tokens per minute or concurrency limit refuses (Retry-After set).
            NeverAdmitted: the request needs more than a limit or quota holds in all (400, no retry).
            QuotaExceeded: a day/month quota is spent (message names it and when it resets);
                `BudgetExceeded` for a budget (names it, what is left and when it resets).
            StoreUnavailable: the store is down and fail-open is off or its window has passed.
        """
        granted = self.admit_at_once(principal, model, cost_tokens, cost_micros)
        if granted is not None:
            return granted
        spec = self._tenants[principal.tenant]  # admit_at_once refused a tenant not configured
        now = self._clock()
        held = principal.background
        if ls.leaseable(self, principal):
            return await ls.admit_leased(self, principal, spec, model, cost_tokens, cost_micros)
        shape = self.shapes.of(principal, spec, now)
        buckets, leases, quota_checks, quota_ops = shape.checks(cost_tokens)
        budgets = shape.budgets
        budget_ops = shape.budget_ops(cost_micros)
        counters = quota_ops + budget_ops
        lease_id = self.reservation_id()
        # what to give back should this process die before settling (see `recover`)
        journal = Journal(self.instance, [c.op.key for c in leases], counters) if leases or counters else None
        kwargs = dict(
            lease_id=lease_id,
            lease_ttl_s=self._lease_ttl_s,
            buckets=[b.op for b in buckets],
            leases=[c.op for c in leases],
            counters=counters,
            now=now,
            journal=journal,
        )
        result, degraded = await self._acquire(kwargs, now, fail_open=held is None)
        headers = rl.ratelimit_headers(buckets, result.buckets)
        if not result.ok:
            over = budgeting.budget_denials(result, len(quota_checks), budgets)
            error = refusal(principal.tenant, result, buckets, leases, quota_checks, headers, now, over, cost_micros)
            if over:
                for check, used in over:
                    self.budget_watch.refused(check, used)
            self.stats[error.code if isinstance(error, QuotaExceeded) else "rate_limited"] += 1
            raise error
        if budgets and not degraded:
            self.budget_watch.admitted(budgets, result.counters[len(quota_ops) :], cost_micros)
        return self._granted(
            principal,
            model,
            cost_tokens,
            now,
            lease_id,
            shape,
            headers=headers,
            degraded=degraded,
            cost_micros=cost_micros,
            budgets=budget_ops,
        )

    def admit_at_once(
        self, principal: Principal, model: str, cost_tokens: int, cost_micros: int = 0
    ) -> Reservation | None:
        """`admit` without waiting, where admission needs nothing of the store: the tenant has no
        limits, key limits, quotas or budget, nor the key its own. None where it does: call `admit`.
        Raises as `admit` does.

        Such a request cannot be refused or wait, so the gateway admits it without the task that
        guards a store round trip against its caller's cancellation.
        """
        if principal.tenant not in self._tenants:
            raise Unauthenticated(
                f"API key {principal.key_id} belongs to a tenant that is no longer configured"
            )
        if isinstance(cost_tokens, bool) or not isinstance(cost_tokens, int) or cost_tokens < 0:
            raise ValueError(f"cost_tokens must be a non-negative int, got {cost_tokens!r}")
        if isinstance(cost_micros, bool) or not isinstance(cost_micros, int) or cost_micros < 0:
            raise ValueError(f"cost_micros must be a non-negative int, got {cost_micros!r}")
        if principal.tenant not in self._unchecked or principal.limits is not None or principal.budget is not None:
            spec = self._tenants[principal.tenant]
            return ls.admit_local(self, principal, spec, model, cost_tokens, cost_micros) if ls.leaseable(self, principal) else None
        now = self._clock()
        shape = self.shapes.of(principal, self._tenants[principal.tenant], now)
        r = self._granted(principal, model, cost_tokens, now, self.reservation_id(), shape, cost_micros=cost_micros)  # fmt: skip
        # nothing to check, only usage to record: with leases it goes with the next batch too
        r.leased = self.leases is not None and principal.background is None
        return r

    def reservation_id(self) -> str:
        """A new reservation id (the store's settle id of the request)."""
        return f"{self._id_prefix}{next(self._ids)}"

    def _granted(
        self,
        principal: Principal,
        model: str,
        cost_tokens: int,
        now: float,
        lease_id: str,
        shape: Shape,
        *,
        headers: dict[str, str] | None = None,
        degraded: bool = False,
        cost_micros: int = 0,
        budgets: list[CounterOp] | None = None,
    ) -> Reservation:
        """The reservation of an admitted request (counted; a batch line's hold marked reserved)."""
        self.stats["admitted"] += 1
        held = principal.background
        if held is not None:
            held.reserved = True
        return Reservation(
            id=lease_id,
            tenant=principal.tenant,
            key_id=principal.key_id,
            model=model,
            cost_tokens=cost_tokens,
            admitted_at=now,
            day=shape.day,
            month=shape.month,
            token_buckets=shape.token_buckets,
            token_quotas=shape.token_quotas,
            request_quotas=shape.request_quotas,
            lease_keys=shape.lease_keys,
            headers=headers or {},
            degraded=degraded,
            renewed_at=now,
            held=held,
            cost_micros=cost_micros,
            budgets=budgets or [],
        )

    async def _acquire(self, kwargs: dict, now: float, fail_open: bool = True) -> tuple[AcquireResult, bool]:
        if not (kwargs["buckets"] or kwargs["leases"] or kwargs["counters"]):
            return AcquireResult(True, [], [], []), False  # an unlimited tenant: nothing to check
        try:
            result = await self._store.acquire(**kwargs)
        except StoreUnavailable as exc:
            if self._down_since is None:
                self._down_since = now
            # never for a batch line: its settlement must reach the shared store with its record
            if fail_open and self._fail_open_s > 0 and now - self._down_since <= self._fail_open_s:
                log.warning("state_store_down_failing_open", error=exc.detail, down_s=now - self._down_since)
                result = await self._local.acquire(**{**kwargs, "journal": None})
                self.stats["fail_open"] += result.ok
                return result, True
            self.stats["store_unavailable"] += 1
            log.error("state_store_down_failing_closed", error=exc.detail)
            raise
        self._down_since = None
        if self._pending:
            await self._flush_pending()
        return result, False

    async def heartbeat(self, ttl_s: float) -> None:
        """Tell the store this process is alive for `ttl_s` more seconds (its reservations are not orphans)."""
        await self._store.heartbeat(self.instance, self._clock() + ttl_s)

    async def recover(self) -> int:
        """Give back what processes that died left reserved (requests' reservations, leases' slices and
        slots); returns how many. See `settles.recover_orphans`."""
        return await st.recover_orphans(self._store, self._clock())

    async def check_stream(self, reservation: Reservation, tokens_so_far: int) -> bool:
        """Whether a stream may go on: False once it passes its reservation (cut it, then reconcile).

        Also renews the concurrency lease of a long stream (a store call every lease_ttl_s / 3 at most).
        """
        now = self._clock()
        if (
            reservation.lease_keys
            and not reservation.degraded
            and not reservation.leased  # a lease's slots are renewed by its ticks
            and now - reservation.renewed_at > self._lease_ttl_s / 3
        ):
            reservation.renewed_at = now
            try:
                await self._store.renew(lease_id=reservation.id, keys=reservation.lease_keys, ttl_s=self._lease_ttl_s, now=now)
            except StoreUnavailable as exc:
                log.warning("lease_renew_failed", error=exc.detail, reservation=reservation.id)
        return tokens_so_far <= reservation.cost_tokens

    def headers(self, reservation: Reservation) -> dict[str, str]:
        """The x-ratelimit-* headers of an admitted request (as computed at admission)."""
        return dict(reservation.headers)

    async def usage(self, tenant: str | None = None) -> list[UsageRow]:
        """Usage rows per tenant, model and period ("2026-11-21", "2026-11"); this process's lease batch first."""
        await self.flush()
        return await self._store.usage(tenant)

    async def flush(self) -> None:
        """Write the lease strategy's pending batch now (nothing with the per-request strategy)."""
        if self.leases is not None:
            await self.leases.flush(retake=False)

    async def close(self) -> None:
        """Give back the slices and idle slots held, write the last batch (shutdown; still usable after)."""
        if self.leases is not None:
            await self.leases.close()

    async def key_usage(self, tenant: str | None = None) -> list[KeyUsageRow]:
        """Usage rows per key, model, deployment and day, with each month's sum beside its days."""
        await self.flush()
        return st.with_months(await self._store.key_usage(tenant))
