"""`sqlite:///path`: the embedded default, durable and shared by every process on one host.

The package: `store` (`SqliteStore`, the StateStore operations as SQL), `group_commit` (the
connections and the group commit every operation runs through), `txn` (the accounting engine's
view of one transaction), `schema` (the tables and the rows read back).
"""

from __future__ import annotations

from policies.stores.sqlite.store import SqliteStore

__all__ = ["SqliteStore"]
