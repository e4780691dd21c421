"""Block manager: allocation, ref counts, prefix caching, per-scope isolation, LRU eviction (pure Python)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from backends.torch_llm.block_manager import BlockManager
from backends.torch_llm.sequence import Sequence


def seq(i: int, tokens: list[int], scope: str = "") -> Sequence:
    return Sequence(i, f"r{i}", tokens, max_tokens=8, cache_scope=scope)


def compute(bm: BlockManager, s: Sequence, n: int) -> None:
    """What the engine does around a step: allocate, 'compute', register full blocks."""
    bm.allocate(s, n)
    s.num_computed_tokens += n
    bm.cache_full_blocks(s)


def test_block_manager_and_scheduler_import_no_torch() -> None:
    code = (
        "import sys, backends.torch_llm.scheduler, backends.torch_llm.block_manager, backends.torch_llm.options;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_rounds_up_to_blocks_and_free_returns_them() -> None:
    bm = BlockManager(10, 4)
    s = seq(0, list(range(9)))
    assert bm.blocks_needed(s, 9) == 3
    compute(bm, s, 9)
    assert len(s.block_table) == 3 and bm.num_free_blocks == 7
    # One more token fits in the third block; the 13th needs a fourth.
    assert bm.blocks_needed(s, 3) == 0 and bm.blocks_needed(s, 4) == 1
    bm.free(s)
    assert bm.num_free_blocks == 10 and s.block_table == []


def test_can_allocate_refuses_when_pool_is_short() -> None:
    bm = BlockManager(2, 4)
    s = seq(0, list(range(12)))
    assert not bm.can_allocate(s, 12)
    with pytest.raises(RuntimeError):
        bm.allocate(s, 12)
    assert bm.num_free_blocks == 2


def test_prefix_hits_share_blocks_with_ref_counts() -> None:
    bm = BlockManager(10, 4)
    a = seq(0, list(range(10)))
    compute(bm, a, 10)  # blocks 0..1 full, third partial
    b = seq(1, list(range(8)) + [99, 98, 97])
    hits = bm.match_prefix(b)
    assert hits == a.block_table[:2]
    bm.allocate(b, b.num_tokens - 8, hits)
    assert b.num_computed_tokens == 8
    assert [bm.ref_count(x) for x in hits] == [2, 2]
    bm.free(a)
    assert [bm.ref_count(x) for x in hits] == [1, 1]
    assert b.block_table[2] not in a.block_table


def test_match_leaves_at_least_one_token_to_compute() -> None:
    bm = BlockManager(10, 4)
    a = seq(0, list(range(8)))
    compute(bm, a, 8)
    bm.free(a)
    again = seq(1, list(range(8)))
    assert len(bm.match_prefix(again)) == 1  # the second block would leave nothing to compute


def test_scopes_do_not_share_prefixes() -> None:
    bm = BlockManager(10, 4)
    a = seq(0, list(range(9)), scope="acme")
    compute(bm, a, 9)
    assert bm.match_prefix(seq(1, list(range(9)), scope="beta")) == []
    assert len(bm.match_prefix(seq(2, list(range(9)), scope="acme"))) == 2


def test_chained_hash_depends_on_earlier_blocks() -> None:
    bm = BlockManager(10, 4)
    compute(bm, a := seq(0, [1, 2, 3, 4, 5, 6, 7, 8, 9]), 9)
    del a
    # Same second block, different first block: no hit at all.
    assert bm.match_prefix(seq(1, [9, 9, 9, 9, 5, 6, 7, 8, 9])) == []


def test_lru_evicts_least_recently_freed_cached_block() -> None:
    bm = BlockManager(4, 2)
    a, b = seq(0, [1, 2, 3]), seq(1, [7, 8, 9])
    compute(bm, a, 3)
    compute(bm, b, 3)
    bm.free(a)  # a's blocks are freed first -> evicted first
    bm.free(b)
    assert bm.num_cached_blocks == 2
    c = seq(2, [5, 5, 5])
    compute(bm, c, 3)  # takes 2 blocks: the two of a (least recently freed)
    assert bm.match_prefix(seq(3, [1, 2, 3])) == []
    assert len(bm.match_prefix(seq(4, [7, 8, 9]))) == 1
    assert bm.num_evictions >= 1


def test_taking_a_free_cached_block_counts_against_free_space() -> None:
    bm = BlockManager(2, 2)
    a = seq(0, [1, 2, 3])
    compute(bm, a, 3)
    bm.free(a)
    b = seq(1, [1, 2, 3, 4, 5])
    hits = bm.match_prefix(b)
    assert len(hits) == 1
    # 1 hit (free) + 2 new blocks needed > 2 free blocks.
    assert not bm.can_allocate(b, 3, hits)
    assert bm.can_allocate(b, 2, hits)


def test_prefix_caching_disabled_never_matches() -> None:
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    compute(bm, seq(0, list(range(9))), 9)
    assert bm.match_prefix(seq(1, list(range(9)))) == []
