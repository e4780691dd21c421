"""A share of a concurrency limit held by this process: slots taken from the store one at a time.

Each slot is a store lease of its own (journaled: the crash recovery of a dead process releases it,
and it expires if not renewed). A request takes a free slot of the process's share, or one more slot
from the store; a finished request leaves its slot to the next; slots idle for `slot_idle_s` go back.
The sum of every process's slots is counted by the store against the limit, so concurrency stays
exact; a slot idle in one process is unavailable to another for at most `slot_idle_s` plus a tick.
"""

from __future__ import annotations


class SlotPool:
    """The slots of one concurrency key held by this process."""

    __slots__ = ("limit", "held", "busy", "extra", "peak", "checked_at")

    def __init__(self, limit: int, now: float) -> None:
        self.limit = limit
        #: store lease ids of the slots held
        self.held: list[str] = []
        #: slots in use by requests; `extra`: requests admitted beyond the held slots while the store
        #: was cut off (partition tolerance), charged to no store lease
        self.busy = 0
        self.extra = 0
        #: the most slots in use since `checked_at` (what is kept at the next idle check)
        self.peak = 0
        self.checked_at = now

    def take(self) -> bool:
        """Use a free held slot; False when every held slot is busy."""
        if self.busy >= len(self.held):
            return False
        self.busy += 1
        self.peak = max(self.peak, self.busy)
        return True

    def add(self, slot_id: str) -> None:
        """A slot just taken from the store, in use by the request that took it."""
        self.held.append(slot_id)
        self.busy += 1
        self.peak = max(self.peak, self.busy)

    def release(self) -> None:
        """A request ended: its slot is free again (an outage's extra one first)."""
        if self.extra:
            self.extra -= 1
        elif self.busy:
            self.busy -= 1

    def surplus(self, now: float, idle_s: float) -> list[str]:
        """Slots idle since the last check (`idle_s` ago at least): removed here, to be released."""
        if now - self.checked_at < idle_s:
            return []
        keep = max(self.busy, self.peak)
        freed, self.held = self.held[keep:], self.held[:keep]
        self.peak, self.checked_at = self.busy, now
        return freed

    def take_all(self) -> list[str]:
        """Every held slot that no request uses (a shutdown or a reload returns them)."""
        freed, self.held = self.held[self.busy :], self.held[: self.busy]
        return freed
