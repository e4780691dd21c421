"""Attention over a paged KV cache: one interface, implementations chosen by device.

The cache of one layer is two tensors `[num_blocks * block_size, kv_heads, head_dim]` addressed by
*slot* (`block_id * block_size + offset`). A step's tokens are flattened into one batch: the decode
tokens (one per sequence) first, then prefill chunks. New keys/values are written to their slots,
then each query attends to the slots of its sequence's context:

- decodes: sorted by context length and cut into groups of similar lengths; each group's contexts
  are gathered into one padded `[B, kv_heads, max_ctx, head_dim]` tensor and attended with a single
  SDPA call (padding masked out), so padding stays small;
- prefill chunks: one SDPA call per sequence, causal within the chunk and over its cached prefix.

`TorchPagedAttention` runs on CPU and CUDA. The CUDA selection currently uses the same gather + SDPA
code (SDPA picks its flash / memory-efficient kernels there); a fused paged-decode kernel and CUDA
graphs are not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's chunk of new tokens with more than one query."""

    start: int  # first row of the chunk in the flattened batch
    num_queries: int  # tokens in the chunk
    context_slots: torch.Tensor  # [ctx] long: cache slots of positions 0..ctx-1 (chunk included)


@dataclass
class DecodeGroup:
    """Decode rows [start, start + B) with similar context lengths, attended in one padded call."""

    start: int
    slots: torch.Tensor  # [B, max_ctx] long, padded with slot 0
    mask: torch.Tensor  # [B, 1, 1, max_ctx] bool, True where a key is real


@dataclass
class AttentionMetadata:
    """Where a step's tokens go in the cache and what each attends to (built by the runner)."""

    slot_mapping: torch.Tensor  # [T] long: cache slot of every new token
    decodes: list[DecodeGroup] = field(default_factory=list)  # single-token rows, by context length
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchPagedAttention:
    """Gather + `scaled_dot_product_attention` over paged blocks (CPU and CUDA)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [slots, KVH, D]
        v_cache: torch.Tensor,  # [slots, KVH, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        gqa = self.num_heads != self.num_kv_heads
        for group in meta.decodes:
            b, c = group.slots.shape
            flat = group.slots.reshape(-1)
            kk = k_cache.index_select(0, flat).view(b, c, self.num_kv_heads, self.head_dim).transpose(1, 2)
            vv = v_cache.index_select(0, flat).view(b, c, self.num_kv_heads, self.head_dim).transpose(1, 2)
            qq = q[group.start : group.start + b].unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(
                qq, kk, vv, attn_mask=group.mask, scale=self.scale, enable_gqa=gqa
            )
            out[group.start : group.start + b] = o.squeeze(2)
        for chunk in meta.prefills:
            rows = slice(chunk.start, chunk.start + chunk.num_queries)
            qq = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
            ctx = chunk.context_slots.numel()
            if ctx == chunk.num_queries:
                # No cached prefix: attend to the chunk's own keys, causally.
                kk = k[rows].transpose(0, 1).unsqueeze(0)
                vv = v[rows].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(
                    qq, kk, vv, is_causal=True, scale=self.scale, enable_gqa=gqa
                )
            else:
                kk = (
                    k_cache.index_select(0, chunk.context_slots).transpose(0, 1).unsqueeze(0)
                )  # [1, KVH, C, D]
                vv = v_cache.index_select(0, chunk.context_slots).transpose(0, 1).unsqueeze(0)
                offset = ctx - chunk.num_queries
                qpos = torch.arange(chunk.num_queries, device=q.device).unsqueeze(1) + offset
                mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # [Q, C]
                o = F.scaled_dot_product_attention(
                    qq, kk, vv, attn_mask=mask, scale=self.scale, enable_gqa=gqa
                )
            out[rows] = o.squeeze(0).transpose(0, 1)
        return out


def make_attention(
    device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int
) -> TorchPagedAttention:
    """The attention implementation for `device` (both devices share the gather + SDPA path today)."""
    del device  # one implementation for now; the hook exists so a fused CUDA kernel can slot in
    return TorchPagedAttention(num_heads, num_kv_heads, head_dim)
