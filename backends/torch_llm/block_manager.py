"""The pool of KV-cache blocks: allocation, ref counts, prefix caching and LRU eviction.

Pure Python: it hands out block ids; the tensors live in the model runner. A block is *free* when no
sequence references it (ref count 0). A free block may still hold a cached prefix (it keeps its hash)
until it is reused: free blocks form one LRU list, the least recently freed is reused first, and
reusing a cached block evicts its hash. Hashes are chained (each full block's hash covers its parent's
hash and its own tokens) and seeded with a scope, so two tenants never share blocks unless the scope
is global.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from backends.torch_llm.sequence import Sequence


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Chained hash of one full block: covers every token before it through `parent`."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def scope_root(scope: str) -> bytes:
    """The parent hash of a scope's first block."""
    return hashlib.sha256(b"fleetgate-prefix:" + scope.encode()).digest()


class BlockManager:
    """Hands out fixed-size KV blocks to sequences.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: keep full blocks addressable by their chained hash after use.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        # Free blocks, least recently freed first. Values are unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0

    # --- state ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence uses (cached prefixes among them can be evicted)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """New blocks `seq` needs to hold `num_new_tokens` more computed tokens."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    # --- prefix caching ------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the leading full blocks of `seq` (nothing is taken yet).

        At least one token is always left to compute, so the step that admits the sequence
        produces the logits of its last token.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        parent = scope_root(seq.cache_scope)
        hits: list[int] = []
        for i in range(max_blocks):
            h = block_hash(parent, seq.token_ids(i * self.block_size, (i + 1) * self.block_size))
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
            parent = h
        return hits

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks of `seq` that its computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_full):
            parent = seq.block_hashes[-1] if seq.block_hashes else scope_root(seq.cache_scope)
            h = block_hash(parent, seq.token_ids(i * bs, (i + 1) * bs))
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            # The same content may have been computed twice concurrently; keep the first copy.
            if h not in self._cached and self._hash_of[block] is None:
                self._cached[h] = block
                self._hash_of[block] = h

    # --- allocation ----------------------------------------------------------------------------

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None
    ) -> bool:
        """Whether `allocate(seq, num_new_tokens, cached_blocks)` would succeed."""
        cached_blocks = cached_blocks or []
        # Taking a free cached block removes it from the free list as well.
        taken_free = sum(1 for b in cached_blocks if self._ref_counts[b] == 0)
        needed = self._needed_after_hits(seq, num_new_tokens, len(cached_blocks))
        return needed + taken_free <= len(self._free)

    def allocate(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None) -> None:
        """Give `seq` the blocks for `num_new_tokens` more tokens, after taking `cached_blocks`.

        `cached_blocks` (from `match_prefix`) are only accepted while `seq` holds no blocks; they
        count as computed tokens.

        Raises:
            RuntimeError: when the pool is too small (call `can_allocate` first).
        """
        if not self.can_allocate(seq, num_new_tokens, cached_blocks):
            raise RuntimeError("out of KV blocks")
        if cached_blocks:
            if seq.block_table:
                raise RuntimeError("prefix hits can only be taken by a sequence without blocks")
            for block in cached_blocks:
                self._take(block)
                seq.block_hashes.append(self._hash_of[block])  # type: ignore[arg-type]
            seq.block_table = list(cached_blocks)
            seq.num_computed_tokens = len(cached_blocks) * self.block_size
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Release every block of `seq`; cached ones stay addressable until evicted."""
        # Tail blocks first, so the LRU order evicts a sequence's tail before its shared head.
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
        seq.block_table = []
        seq.block_hashes = []

    # --- internals -----------------------------------------------------------------------------

    def _needed_after_hits(self, seq: Sequence, num_new_tokens: int, num_hits: int) -> int:
        computed = seq.num_computed_tokens if not num_hits else num_hits * self.block_size
        have = len(seq.block_table) if not num_hits else num_hits
        return max(0, -(-(computed + num_new_tokens) // self.block_size) - have)

    def _take(self, block: int) -> None:
        if self._ref_counts[block] == 0:
            del self._free[block]
        self._ref_counts[block] += 1

    def _evict(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None:
            self._hash_of[block] = None
            if self._cached.get(h) == block:
                del self._cached[h]
            self.num_evictions += 1
