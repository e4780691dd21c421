"""Tenant policy types, decoded straight from the `tenants:` config section.

All are frozen msgspec Structs with `forbid_unknown_fields`, so a typo in the config is an error that
names the field, and every numeric value is validated in `__post_init__` (msgspec turns a ValueError
raised there into a `ValidationError` carrying the config path).
"""

from __future__ import annotations

import fnmatch
import math
from datetime import datetime

import msgspec

from fleetgate.spec import SpecBase


def _check_positive(owner: str, **values: int | None) -> None:
    for name, value in values.items():
        if value is None:
            continue
        # bool is an int subclass: `requests_per_minute: true` must not mean 1.
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{owner}.{name} must be a positive integer or null, got {value!r}")


class Limits(SpecBase):
    """Rate limits. `None` means unlimited. Rates are smooth (token bucket over one minute)."""

    #: requests per minute; beyond, 429 with Retry-After
    requests_per_minute: int | None = None
    #: tokens (prompt + output, or tensor rows) per minute; beyond, 429 with Retry-After
    tokens_per_minute: int | None = None
    #: requests in flight at once; one more gets 429
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        _check_positive(
            "limits",
            requests_per_minute=self.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute,
            max_concurrency=self.max_concurrency,
        )


class Quotas(SpecBase):
    """Budgets per UTC calendar day and month. `None` means unlimited."""

    #: tokens per UTC day; beyond, 429 until the day ends
    tokens_per_day: int | None = None
    #: tokens per UTC calendar month
    tokens_per_month: int | None = None
    #: requests per UTC day
    requests_per_day: int | None = None
    #: requests per UTC calendar month
    requests_per_month: int | None = None

    def __post_init__(self) -> None:
        _check_positive(
            "quotas",
            tokens_per_day=self.tokens_per_day,
            tokens_per_month=self.tokens_per_month,
            requests_per_day=self.requests_per_day,
            requests_per_month=self.requests_per_month,
        )


class Budget(SpecBase):
    """A spending limit in USD per UTC day and/or calendar month. `None` means unlimited."""

    #: USD per UTC day; beyond, 429 until the day ends
    usd_per_day: float | None = None
    #: USD per UTC calendar month; beyond, 429 until the month ends
    usd_per_month: float | None = None

    def __post_init__(self) -> None:
        for name in ("usd_per_day", "usd_per_month"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"budget.{name} must be a finite number > 0 or null, got {value!r}")


class TenantSpec(SpecBase):
    """One tenant: fair-share weight, tenant-wide limits and quotas, visible models, per-key limits.

    Attributes:
        weight: fair-share weight used by the fair queue (> 0).
        limits: limits shared by all keys of the tenant.
        quotas: day/month budgets shared by all keys of the tenant.
        models: globs (fnmatch) of the model names this tenant may see.
        key_limits: limits applied to each key of the tenant on its own (None: no per-key limits).
        budget: spending limit in USD per day/month shared by all keys of the tenant (None: none).
    """

    weight: float = 1.0
    limits: Limits = msgspec.field(default_factory=Limits)
    quotas: Quotas = msgspec.field(default_factory=Quotas)
    models: list[str] = msgspec.field(default_factory=lambda: ["*"])
    key_limits: Limits | None = None
    budget: Budget | None = None

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not (self.weight > 0) or self.weight == float("inf"):
            raise ValueError(f"weight must be a positive finite number, got {self.weight!r}")
        if not self.models:
            raise ValueError("models must list at least one glob (use ['*'] for all models)")
        for glob in self.models:
            if not isinstance(glob, str) or not glob.strip():
                raise ValueError(f"models must be non-empty strings, got {glob!r}")

    def allows_model(self, model_name: str) -> bool:
        """Whether a model name matches one of this tenant's globs."""
        return any(fnmatch.fnmatchcase(model_name, glob) for glob in self.models)


class UsageRow(msgspec.Struct, kw_only=True, frozen=True):
    """Usage of one tenant on one model in one UTC period ("2026-11-21" for a day, "2026-11" a month).

    `cost_usd` is the spend at the prices configured when each request settled (summed exactly in
    integer micro-USD by the store, shown in USD).
    """

    tenant: str
    model: str
    period: str
    requests: int
    tokens: int
    cost_usd: float = 0.0


class KeyUsageRow(msgspec.Struct, kw_only=True, frozen=True):
    """Usage and spend of one key on one model, served by one deployment, in one UTC day.

    `key_id` is the API key's public id (or `jwt:<subject>` for a token's subject); `model` is what
    the caller asked for (a LoRA adapter's name for an adapter), `deployment` what served it.
    """

    tenant: str
    key_id: str
    model: str
    deployment: str
    period: str
    requests: int
    tokens: int
    cost_usd: float = 0.0


class KeyRecord(msgspec.Struct, kw_only=True, frozen=True):
    """One API key as shown to admins: never the secret, never its hash.

    Attributes:
        key_id: public id, also the lookup prefix of the secret (`fg-<key_id>-<secret>`).
        tenant: tenant the key belongs to.
        models: model globs the key is restricted to (`["*"]`: all of its tenant's models).
        name: free label given at creation.
        created_at: creation time (UTC).
        expires_at: expiry time (UTC), or None for a key that does not expire.
        revoked_at: revocation time (UTC), or None while the key is not revoked.
        last_used_at: when the key last authenticated (UTC, to about a minute: see KeyService), or None.
        limits: this key's own rate limits, beside its tenant's (None: only the tenant's).
        budget: this key's own spending limit, beside its tenant's (None: only the tenant's).
    """

    key_id: str
    tenant: str
    models: list[str]
    name: str | None = None
    created_at: datetime
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None
    limits: Limits | None = None
    budget: Budget | None = None

    def active(self, now: float) -> bool:
        """Whether the key authenticates at epoch time `now` (not revoked, not expired)."""
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or now < self.expires_at.timestamp()
