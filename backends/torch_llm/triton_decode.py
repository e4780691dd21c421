"""A Triton kernel for paged decode attention: one query token per sequence, read through block tables.

Imported only when the Triton path is selected (it imports `triton` at module level). On CUDA it
compiles to a GPU kernel; on CPU it runs only under `TRITON_INTERPRET=1` (how the tests check it).

One program handles one (sequence, KV head) pair and all the query heads that share that KV head
(grouped-query attention), so each key/value is loaded once per group, not once per query head. It
walks the sequence's context in tiles of `TILE` positions; each position is mapped to its cache slot
through the block table (`block_table[pos // block_size] * block_size + pos % block_size`) and
keys/values are loaded straight from the pool - nothing is gathered into a padded copy. Softmax is the
online (running max / running sum) form in float32, so any context length takes one pass.

Not done (worth it for long contexts at small batch): splitting one sequence's context over several
programs (flash-decoding), which would raise parallelism when batch x KV heads is below the SM count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [slots, KVH, D]
    v_cache_ptr,  # [slots, KVH, D]
    block_table_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D]
    scale,
    stride_qb,
    stride_qh,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    TILE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + seq)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    q_offs = seq * stride_qb + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    q = q * scale
    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)  # running max of the scores
    l_i = tl.zeros([GROUP_P2], tl.float32)  # running sum of exp(score - max)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)
    for start in range(0, ctx, TILE):
        pos = start + tl.arange(0, TILE)
        p_ok = pos < ctx
        block = tl.load(block_table_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=p_ok, other=0)
        slot = block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
        kv_offs = slot[:, None] * stride_cs + kv_head * stride_ch + d[None, :]
        kv_ok = p_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(tl.float32)  # [TILE, D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, TILE]
        s = tl.where(p_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_ok, other=0.0).to(tl.float32)  # [TILE, D]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    o_offs = seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def _tile(group_p2: int, head_dim_p2: int) -> int:
    """Keys per iteration: the [group, tile, head_dim] product stays near 8K elements (registers)."""
    return max(16, min(128, 8192 // (group_p2 * head_dim_p2)))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [slots, KVH, D]
    v_cache: torch.Tensor,  # [slots, KVH, D]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, >= 1
    *,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,  # [B, H, D]
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context (its own key included).

    The caches must already hold the new token's key/value. Returns `out` (allocated when None).
    """
    b, h, d = q.shape
    kvh = k_cache.shape[1]
    if h % kvh:
        raise ValueError(f"{h} query heads are not a multiple of {kvh} KV heads")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("q and the caches must be contiguous in head_dim, with equal cache strides")
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    group = h // kvh
    group_p2, d_p2 = triton.next_power_of_2(group), triton.next_power_of_2(d)
    _paged_decode_kernel[(b, kvh)](
        q, k_cache, v_cache, block_table, context_lens, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_P2=group_p2, HEAD_DIM=d, HEAD_DIM_P2=d_p2,
        TILE=_tile(group_p2, d_p2),
    )  # fmt: skip
    return out
