"""Continuous batching: which sequences run in the next step, and how many tokens of each.

Pure Python. Each step has a token budget (`max_num_batched_tokens`) and a sequence cap
(`max_num_seqs`). Running sequences go first (decodes cost one token; unfinished prompts continue
with the next chunk), then waiting ones in the order the waiting queue gives (FCFS by default; the
gateway's fair-queue policy can supply its own). When a step carries decodes, its prompt tokens are
further capped (`max_prefill_tokens_with_decodes`): a step's duration grows with its tokens, and every
running sequence waits for the whole step, so a long prefill chunk would stall all decodes
(inter-token latency); a step without decodes still takes the full budget (time to first token). When blocks run out, the most recently admitted
running sequence is preempted by recompute: its blocks are freed and it goes back to the front of
the waiting queue, to replay prompt + generated tokens later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from backends.torch_llm.block_manager import BlockManager
from backends.torch_llm.sequence import Sequence, SequenceStatus


class WaitingQueue(Protocol):
    """The order in which waiting sequences are admitted (the pluggable policy hook)."""

    def add(self, seq: Sequence) -> None:
        """A new request arrived."""

    def add_preempted(self, seq: Sequence) -> None:
        """A preempted sequence returns; it should be admitted again soon."""

    def peek(self) -> Sequence | None:
        """The sequence to admit next (None when empty)."""

    def pop(self) -> Sequence:
        """Remove and return what `peek` returned."""

    def remove(self, seq: Sequence) -> bool:
        """Remove `seq` (aborted); False when it was not queued."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Sequence]: ...


class FCFSQueue:
    """First come, first served; preempted sequences go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        self._queue.append(seq)

    def add_preempted(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)

    def peek(self) -> Sequence | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def remove(self, seq: Sequence) -> bool:
        try:
            self._queue.remove(seq)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._queue)


@dataclass
class SchedulerOutput:
    """What one step computes."""

    #: (sequence, number of new tokens to compute this step), running ones first.
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    #: total tokens in the step (sum of the second elements above).
    num_batched_tokens: int = 0
    #: sequences preempted while scheduling this step (now waiting again).
    preempted: list[Sequence] = field(default_factory=list)
    #: prompt tokens looked up in the prefix cache, and how many of them hit, for new admissions.
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides each step's batch.

    Args:
        block_manager: the KV block pool.
        max_num_seqs: most running sequences.
        max_num_batched_tokens: token budget per step.
        waiting: the waiting-order policy (FCFS when None).
        max_prefill_tokens_with_decodes: most prompt tokens in a step that also runs decodes
            (None: only `max_num_batched_tokens` limits them).
        max_adapters: most distinct LoRA adapters among running sequences (the device slots); a
            waiting request of another adapter waits until one of them has no running sequence.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        waiting: WaitingQueue | None = None,
        max_prefill_tokens_with_decodes: int | None = None,
        max_adapters: int | None = None,
    ) -> None:
        if max_prefill_tokens_with_decodes is not None and max_prefill_tokens_with_decodes < 1:
            raise ValueError("max_prefill_tokens_with_decodes must be >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes
        self.max_adapters = max_adapters
        self.waiting: WaitingQueue = waiting if waiting is not None else FCFSQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.add(seq)

    def schedule(self) -> SchedulerOutput:
        """Pick the next step's batch, allocating (and, if needed, preempting) KV blocks."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prefill_budget = self._prefill_budget()
        bm = self.block_manager
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            pending = seq.num_uncomputed_tokens
            num_new = min(pending, budget) if pending == 1 else min(pending, budget, prefill_budget)
            if num_new == 0:  # a prompt whose chunk waits for a step with prefill budget left
                i += 1
                continue
            if pending > 1:
                prefill_budget -= num_new
            while not bm.can_allocate(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            bm.allocate(seq, num_new)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            i += 1
        # Admitting new work right after a preemption would only cause more of it.
        if not out.preempted:
            budget = self._admit_waiting(out, budget, prefill_budget)
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may take: capped when any running sequence is decoding."""
        cap = self.max_prefill_tokens_with_decodes
        if cap is not None and any(s.num_uncomputed_tokens == 1 for s in self.running):
            return cap
        return self.max_num_batched_tokens

    def _admit_waiting(self, out: SchedulerOutput, budget: int, prefill_budget: int) -> int:
        bm = self.block_manager
        while min(budget, prefill_budget) > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None or not self._adapter_fits(seq):
                break
            hits = bm.match_prefix(seq)
            num_new = min(seq.num_tokens - len(hits) * bm.block_size, budget, prefill_budget)
            if not bm.can_allocate(seq, num_new, hits):
                break
            self.waiting.pop()
            bm.allocate(seq, num_new, hits)
            seq.num_cached_tokens = len(hits) * bm.block_size
            if seq.cached_prompt_tokens is None:
                seq.cached_prompt_tokens = min(seq.num_cached_tokens, seq.num_prompt_tokens)
            out.prefix_queries += seq.num_tokens
            out.prefix_hits += seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, num_new))
            budget -= num_new
            prefill_budget -= num_new
        return budget

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Whether admitting `seq` keeps the running adapters within the device's slots."""
        if self.max_adapters is None or seq.adapter is None:
            return True
        running = {s.adapter for s in self.running if s.adapter is not None}
        return seq.adapter in running or len(running) < self.max_adapters

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished and free its blocks (it must be running or waiting)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        self.waiting.add_preempted(seq)
