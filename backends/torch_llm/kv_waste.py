"""KV-cache waste accounting: how many allocated slots hold no token (pure Python)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.torch_llm.sequence import Sequence


@dataclass
class KVWasteStats:
    """Allocated vs used KV slots of running sequences, summed over steps (steady-state averages).

    Taken after each step's forward pass: `used` is the tokens whose KV is in the cache, `allocated`
    the slots of the blocks the running sequences hold. Blocks are allocated for exactly the tokens a
    step computes (no lookahead) and freed when a sequence finishes, so the gap is the unfilled tail
    of each sequence's last block: about (block_size - 1) / 2 slots per running sequence.
    """

    allocated: int = 0
    used: int = 0
    reserved_max_len: int = 0  # what reserving max_model_len per running sequence would hold
    reserved_request: int = 0  # what reserving prompt + max_tokens per running sequence would hold
    seq_steps: int = 0  # running sequences summed over steps (the averages' denominator)
    steps: int = 0
    last: float = 0.0

    def record(self, running: Iterable[Sequence], block_size: int, max_model_len: int) -> None:
        """Add one step's running sequences (after its forward pass); `last` is this step's waste."""
        running = list(running)
        alloc = sum(len(s.block_table) for s in running) * block_size
        if not alloc:  # nothing running: no step to average, `last` keeps the previous step's
            return
        used = sum(s.num_computed_tokens for s in running)
        self.allocated += alloc
        self.used += used
        self.reserved_max_len += len(running) * max_model_len
        self.reserved_request += sum(min(s.num_prompt_tokens + s.max_tokens, max_model_len) for s in running)
        self.seq_steps += len(running)
        self.steps += 1
        self.last = 1.0 - used / alloc

    def ratio(self, total: int | None = None) -> float:
        total = self.allocated if total is None else total
        return 0.0 if total == 0 else 1.0 - self.used / total

    @property
    def mean_unused_slots(self) -> float:
        """Unused slots per running sequence, averaged over steps."""
        return (self.allocated - self.used) / self.seq_steps if self.seq_steps else 0.0

    @property
    def mean_allocated_slots(self) -> float:
        """Allocated slots per running sequence, averaged over steps."""
        return self.allocated / self.seq_steps if self.seq_steps else 0.0
