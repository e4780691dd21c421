"""Scheduler: token budget, sequence cap, chunked prefill, preemption, waiting-order hook (pure Python)."""

from __future__ import annotations

from backends.torch_llm.block_manager import BlockManager
from backends.torch_llm.scheduler import FCFSQueue, Scheduler
from backends.torch_llm.sequence import Sequence


def seq(i: int, n: int, max_tokens: int = 100) -> Sequence:
    return Sequence(i, f"r{i}", list(range(1, n + 1)), max_tokens=max_tokens)


def finish_step(sched: Scheduler, out) -> None:  # noqa: ANN001
    """Stand-in for the engine: mark computed tokens, append a token to sequences that sampled."""
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        sched.block_manager.cache_full_blocks(s)
        if s.num_computed_tokens == s.num_tokens:
            s.append_token(7)


def make(
    num_blocks: int = 100, block_size: int = 4, seqs: int = 8, tokens: int = 32, waiting=None
) -> Scheduler:  # noqa: ANN001
    return Scheduler(
        BlockManager(num_blocks, block_size),
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        waiting=waiting,
    )


def test_token_budget_and_chunked_prefill() -> None:
    sched = make(tokens=10)
    long = seq(0, 25)
    sched.add(long)
    chunks = []
    while not long.output_token_ids:
        out = sched.schedule()
        assert out.num_batched_tokens <= 10
        chunks.append(out.scheduled[0][1])
        finish_step(sched, out)
    assert chunks == [10, 10, 5]


def test_decodes_run_beside_a_chunked_prefill() -> None:
    sched = make(tokens=8)
    a = seq(0, 3)
    sched.add(a)
    finish_step(sched, sched.schedule())  # a prefilled, now decoding
    b = seq(1, 30)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 7)]


def test_max_num_seqs_caps_running() -> None:
    sched = make(seqs=2)
    for i in range(4):
        sched.add(seq(i, 2))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    sched = make(num_blocks=4, block_size=2, tokens=100)
    a, b = seq(0, 3), seq(1, 3)
    sched.add(a)
    sched.add(b)
    finish_step(sched, sched.schedule())  # 2 blocks each, 4 tokens now
    finish_step(sched, sched.schedule())  # position 3 still fits the second block
    preempted = []
    for _ in range(4):
        out = sched.schedule()
        preempted += out.preempted
        finish_step(sched, out)
    assert preempted and preempted[0] is b  # the most recently admitted one goes
    assert b.num_preemptions >= 1
    assert sched.num_preemptions == len(preempted)
    # b keeps its generated tokens and recomputes them with the prompt once it is readmitted.
    assert b.num_output_tokens >= 2


def test_preempted_sequence_resumes_before_newer_ones() -> None:
    sched = make(num_blocks=3, block_size=2, tokens=100)
    a, b = seq(0, 2), seq(1, 2)
    sched.add(a)
    sched.add(b)
    finish_step(sched, sched.schedule())
    out = sched.schedule()  # each needs a second block; only 1 free -> b is preempted
    assert out.preempted == [b]
    sched.add(c := seq(2, 1))
    assert sched.waiting.peek() is b
    del c


def test_finish_frees_blocks_for_waiting() -> None:
    sched = make(num_blocks=2, block_size=4, tokens=100)
    a, b = seq(0, 8), seq(1, 4)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s for s, _ in out.scheduled] == [a]
    sched.finish(a, "stop")
    assert sched.block_manager.num_free_blocks == 2
    assert [s for s, _ in sched.schedule().scheduled] == [b]


def test_waiting_order_hook_is_used() -> None:
    class Reverse(FCFSQueue):
        def peek(self):  # noqa: ANN201
            return self._queue[-1] if self._queue else None

        def pop(self):  # noqa: ANN201
            return self._queue.pop()

    sched = make(seqs=1, waiting=Reverse())
    for i in range(3):
        sched.add(seq(i, 2))
    out = sched.schedule()
    assert out.scheduled[0][0].seq_id == 2


def test_abort_of_waiting_sequence() -> None:
    sched = make()
    s = seq(0, 4)
    sched.add(s)
    sched.finish(s, "abort")
    assert not sched.has_unfinished and s.finish_reason == "abort"


def test_prefill_tokens_are_capped_only_in_steps_with_decodes() -> None:
    sched = Scheduler(
        BlockManager(100, 4, enable_prefix_caching=False),  # the prompts share prefixes; no hits here
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_prefill_tokens_with_decodes=5,
    )
    a = seq(0, 20)
    sched.add(a)
    out = sched.schedule()  # nothing decodes yet: the whole budget goes to the prompt
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 20)]
    finish_step(sched, out)
    b, c = seq(1, 30), seq(2, 30)
    sched.add(b)
    sched.add(c)
    out = sched.schedule()  # a decodes: b and c share 5 prompt tokens
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 5)]
    finish_step(sched, out)
    out = sched.schedule()  # b continues (running, first in line); c is not admitted
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(0, 1), (1, 5)]
    finish_step(sched, out)
    sched.finish(a, "stop")
    out = sched.schedule()  # no decode left: b finishes its prompt, c gets the rest of the budget
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(1, 20), (2, 12)]


def test_prefill_cap_must_be_positive() -> None:
    import pytest

    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        Scheduler(
            BlockManager(4, 4), max_num_seqs=1, max_num_batched_tokens=8, max_prefill_tokens_with_decodes=0
        )


def test_cached_prompt_tokens_are_those_of_the_first_admission() -> None:
    """A prompt whose leading blocks another request computed reports them as cached; a preempted
    readmission finds its own blocks again, which is no saving on the prompt it was billed for."""
    sched = make(num_blocks=100, block_size=4, tokens=100)
    first = seq(0, 5)
    sched.add(first)
    finish_step(sched, sched.schedule())  # computes and caches the prompt's one full block
    assert first.cached_prompt_tokens == 0
    again = seq(1, 13)  # the same first 5 tokens, then more
    sched.add(again)
    finish_step(sched, sched.schedule())
    assert again.cached_prompt_tokens == 4
    sched._preempt(again)
    finish_step(sched, sched.schedule())  # readmitted: its own 3 blocks are cached by now
    assert again.num_preemptions == 1 and again.num_cached_tokens == 12
    assert again.cached_prompt_tokens == 4
