"""The base of every config Struct, in every package."""

from __future__ import annotations

import msgspec


class SpecBase(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Unknown keys are errors (a typo in the config fails with its path), fields are keyword-only,
    and a decoded spec is immutable."""
