"""The `state.leases` and `state.partition` settings (the config's `state:` section holds them)."""

from __future__ import annotations

from typing import Literal

from fleetgate.spec import SpecBase


class LeaseSettings(SpecBase):
    """How admission takes capacity from the shared store (docs/state.md).

    `leases`: a process takes a slice of a bucket's or a quota's capacity in one store transaction
    and admits from memory until it is spent; usage settles in batches every `flush_s`.
    `per_request`: one store acquire and one settle per request (the exact path leases fall back to).
    """

    #: leases | per_request
    strategy: Literal["leases", "per_request"] = "leases"
    #: a slice holds about this many seconds of the key's recent rate (at least what the request needs)
    slice_s: float = 0.5
    #: a slice never holds more than this share of a limit's capacity, nor of what the store has left
    max_share: float = 0.1
    #: settlements and the slices' unused units go to the store this often (also the window of
    #: settlements a kill -9 can lose: docs/state.md)
    flush_s: float = 0.2
    #: a concurrency slot held by this process but idle this long goes back to the store
    slot_idle_s: float = 0.5

    def __post_init__(self) -> None:
        for name in ("slice_s", "flush_s", "slot_idle_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"leases.{name} must be positive, got {getattr(self, name)!r}")
        if not 0 < self.max_share <= 1:
            raise ValueError(f"leases.max_share must be in (0, 1], got {self.max_share!r}")


class PartitionSettings(SpecBase):
    """Edge partition tolerance: with the store unreachable, admit beyond the slices held, up to a bound.

    The only case where a limit can be exceeded: by at most `max_overspend_fraction` of each limit's
    capacity, for at most `max_seconds` of outage; beyond, requests are refused (503). What was admitted
    is charged to the store, usage recorded, once it answers again.
    """

    #: share of each limit (requests/tokens per minute, quotas, concurrency) admitted beyond it while cut off
    max_overspend_fraction: float = 0.1
    #: how long an outage is tolerated; later, requests the slices cannot cover are refused
    max_seconds: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.max_overspend_fraction <= 1:
            raise ValueError(
                f"partition.max_overspend_fraction must be in [0, 1], got {self.max_overspend_fraction!r}"
            )
        if self.max_seconds <= 0:
            raise ValueError(f"partition.max_seconds must be positive, got {self.max_seconds!r}")
