"""The authenticated caller: which tenant, which key, which models the key may see."""

from __future__ import annotations

import fnmatch
from typing import Any

import msgspec

from policies.types import Budget, Limits


class Principal(msgspec.Struct, frozen=True):
    """Who is calling.

    Attributes:
        tenant: tenant name from the config.
        key_id: public id of the API key (safe to log; never the secret), or `jwt:<subject>` for a
            JWT bearer token (policies/jwt_auth.py): what per-key limits, budgets and usage count by.
        models: model globs the key is restricted to (`("*",)` when the key has no restriction).
        background: set on the requests of a batch job (gateway/batches), never from a credential:
            a `policies.held_settle.HeldSettle` that receives the request's settlement. Such
            requests skip the per-minute rate limits and concurrency limits (quotas still apply)
            and wait in the fair queue's background class.
        limits: the key's own rate limits (beside the tenant's and its `key_limits`), or None.
        budget: the key's own spending limit (beside the tenant's), or None.
    """

    tenant: str
    key_id: str
    models: tuple[str, ...] = ("*",)
    background: Any = None
    limits: Limits | None = None
    budget: Budget | None = None

    def can_see(self, model_name: str, tenant_models: list[str] | tuple[str, ...]) -> bool:
        """Whether this key may see `model_name`: both the key's and the tenant's globs must allow it."""
        return _matches(model_name, self.models) and _matches(model_name, tenant_models)


def _matches(name: str, globs: list[str] | tuple[str, ...]) -> bool:
    # fnmatchcase: model names are case-sensitive on every platform.
    return any(fnmatch.fnmatchcase(name, glob) for glob in globs)
