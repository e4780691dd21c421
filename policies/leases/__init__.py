"""Leases: admission from slices of the store's capacity held in memory, settlement in batches.

`settings` (the `state.leases` and `state.partition` config), `slices` (bucket and quota units taken
ahead), `slots` (a share of a concurrency limit), `ledger` (settlements summed for the next batch),
`path` (`LeasePath`, which ties them to a store). docs/state.md says what each guarantees.
"""

from __future__ import annotations

from policies.leases.path import LeasePath
from policies.leases.settings import LeaseSettings, PartitionSettings

__all__ = ["LeasePath", "LeaseSettings", "PartitionSettings"]
