"""A Triton kernel for paged decode attention: one query token per sequence, read through block tables.

Imported only when the Triton path is selected (it imports `triton` at module level). On CUDA it
compiles to a GPU kernel; on CPU it runs only under `TRITON_INTERPRET=1` (how the tests check it).

One program handles one (sequence, KV head) pair and all the query heads that share that KV head
(grouped-query attention), so each key/value is loaded once per group, not once per query head. It
walks the sequence's context in tiles of `TILE` positions; each position is mapped to its cache slot
through the block table (`block_table[pos // block_size] * block_size + pos % block_size`) and
keys/values are loaded straight from the pool - nothing is gathered into a padded copy. Softmax is the
online (running max / running sum) form in float32, so any context length takes one pass.

When batch x KV heads is below about twice the GPU's multiprocessor count, one program per pair
leaves much of the chip idle and walks the whole context serially (measured on an H100, Llama-3-8B shape, batch 1,
about 520 keys: 112 us per layer for 2 MB of keys and values). So the context is split over `splits`
programs per pair (flash-decoding): each writes its partial result (unnormalised sum, running max,
running sum) and a second kernel combines them. Each program sizes its share from the live context
length, so a grid fixed when a CUDA graph was captured still spreads any context over all splits.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

#: most programs one (sequence, KV head) pair's context is split over
MAX_SPLITS = 32


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, H, D]
    k_cache_ptr,  # [slots, KVH, D]
    v_cache_ptr,  # [slots, KVH, D]
    block_table_ptr,  # [B, max_blocks] int32
    context_lens_ptr,  # [B] int32
    out_ptr,  # [B, H, D] (SPLITS == 1)
    part_acc_ptr,  # [B, H, SPLITS, HEAD_DIM_P2] float32 (SPLITS > 1): unnormalised sums
    part_ml_ptr,  # [B, H, SPLITS, 2] float32 (SPLITS > 1): running max, running sum
    scale,
    stride_qb,
    stride_qh,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ob,
    stride_oh,
    num_heads,
    BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    TILE: tl.constexpr,
    SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + seq)
    # this program's share of the context, in whole tiles (the last shares may be short or empty)
    share = tl.cdiv(tl.cdiv(ctx, SPLITS), TILE) * TILE
    begin = split * share
    end = tl.minimum(begin + share, ctx)
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
    for start in range(begin, end, TILE):
        pos = start + tl.arange(0, TILE)
        p_ok = pos < end
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
    if SPLITS == 1:
        out = acc / l_i[:, None]
        o_offs = seq * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:  # an empty share stores max -inf and sum 0: it weighs nothing in the combine
        row = (seq * num_heads + heads) * SPLITS + split  # [G]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_P2 + d[None, :], acc, mask=g_ok[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_ok)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_ok)


@triton.jit
def _combine_splits_kernel(
    part_acc_ptr,  # [B, H, SPLITS, HEAD_DIM_P2] float32
    part_ml_ptr,  # [B, H, SPLITS, 2] float32
    out_ptr,  # [B, H, D]
    stride_ob,
    stride_oh,
    num_heads,
    SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P2)
    sp_ok = sp < SPLITS
    d = tl.arange(0, HEAD_DIM_P2)
    row = (seq * num_heads + head) * SPLITS + sp
    m = tl.load(part_ml_ptr + row * 2, mask=sp_ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + row * 2 + 1, mask=sp_ok, other=0.0)
    weight = tl.exp(m - tl.max(m, axis=0))  # the first share always holds a key: the max is finite
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_P2 + d[None, :], mask=sp_ok[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l_s * weight, axis=0)
    o_offs = seq * stride_ob + head * stride_oh + d
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Programs per (sequence, KV head): enough for about two per multiprocessor across the batch,
    at most MAX_SPLITS; 1 off CUDA (the interpreter) and wherever the batch fills the GPU alone."""
    if device.type != "cuda":
        return 1
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    return max(1, min(MAX_SPLITS, -(-2 * sms // (batch * kv_heads))))


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
    splits: int | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context (its own key included).

    The caches must already hold the new token's key/value. `splits` programs share each sequence's
    context per KV head (None: `default_splits`). Returns `out` (allocated when None).
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
    splits = default_splits(b, kvh, q.device) if splits is None else splits
    if splits > 1:
        part_acc = torch.empty(b, h, splits, d_p2, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device)
    else:  # unused by the kernel when it writes `out` itself
        part_acc = part_ml = out
    _paged_decode_kernel[(b, kvh, splits)](
        q, k_cache, v_cache, block_table, context_lens, out, part_acc, part_ml, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), h,
        BLOCK_SIZE=block_size, GROUP=group, GROUP_P2=group_p2, HEAD_DIM=d, HEAD_DIM_P2=d_p2,
        TILE=_tile(group_p2, d_p2), SPLITS=splits,
    )  # fmt: skip
    if splits > 1:
        _combine_splits_kernel[(b, h)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), h,
            SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=d, HEAD_DIM_P2=d_p2,
        )  # fmt: skip
    return out
