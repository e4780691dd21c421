"""Paged attention with decode rows computed by the Triton kernel in `triton_decode` (CUDA's fast path).

Prefill chunks keep the SDPA path of `TorchPagedAttention`. If a kernel launch ever raises (a compile
error for a shape the load-time probe did not cover, a driver problem), the instance logs one
warning, switches itself to the gather + SDPA decode path for good, and computes that step with it,
so a request never fails because of the kernel. (An asynchronous CUDA fault, such as an illegal memory
access, poisons the CUDA context and cannot be recovered from by any fallback; the probe in
`attention_select` runs the kernel on the real head configuration before the engine serves.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch

from backends.torch_llm.kernels.triton_decode import paged_decode_attention
from backends.torch_llm.model.attention import TorchPagedAttention

log = structlog.get_logger(__name__)


@dataclass
class TritonDecodes:
    """The decode rows of one step, as the kernel reads them."""

    block_table: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    context_lens: torch.Tensor  # [B] int32: keys of each row (its own new token included)
    block_tables: list[list[int]]  # the same, as lists, for the fallback path
    lengths: list[int]


class TritonPagedAttention(TorchPagedAttention):
    """Decodes with the Triton paged-decode kernel, prefills with SDPA."""

    name = "triton"

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, *, block_size: int, device: torch.device
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size=block_size, device=device)
        self.disabled_reason: str | None = None
        # Raise kernel errors instead of falling back, until the load-time probe has passed.
        self.strict = True
        # Split each context over several programs (`triton_decode.default_splits`): set only while
        # decode graphs are captured and checked (`cuda_graphs`). A step launched eagerly at a small
        # batch is bound by the host's launches, and the split's second kernel costs more host time
        # than it saves on the GPU (H100, Llama-3-8B shape, batch 1: eager steps 17.7 ms without,
        # 25.4 ms with; graph replays 13.0 ms without, 8.9 ms with).
        self.split_contexts = False

    def prepare_decodes(self, block_tables: list[list[int]], context_lens: list[int]) -> Any:
        if self.disabled_reason is not None:
            return super().prepare_decodes(block_tables, context_lens)
        # Width padded to a multiple of 16: Triton specialises integer arguments on divisibility by 16
        # (and on == 1), so a varying row stride would compile new kernel variants mid-serving; this
        # way the variants the load-time probe compiled (one program per pair, and split contexts
        # for the graphs) are the only ones met while serving.
        width = -(-max(len(t) for t in block_tables) // 16) * 16
        table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        return TritonDecodes(table.to(self.device), lens.to(self.device), block_tables, context_lens)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decodes: Any, out: torch.Tensor
    ) -> None:
        if not isinstance(decodes, TritonDecodes):
            self._decode_groups(q, k_cache, v_cache, decodes, out)
            return
        n = decodes.context_lens.shape[0]
        try:
            paged_decode_attention(
                q[:n], k_cache, v_cache, decodes.block_table, decodes.context_lens,
                block_size=self.block_size, scale=self.scale, out=out[:n],
                splits=None if self.split_contexts else 1,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - any kernel failure falls back, never fails the step
            if self.strict:
                raise
            self.disable(f"{type(exc).__name__}: {exc}")
            groups = super().prepare_decodes(decodes.block_tables, decodes.lengths)
            self._decode_groups(q, k_cache, v_cache, groups, out)

    def disable(self, reason: str) -> None:
        """Use gather + SDPA for decodes from now on (logged once)."""
        if self.disabled_reason is None:
            self.disabled_reason = reason
            log.warning(
                "llm_attention_fallback", backend="torch", reason=reason[:500], device=str(self.device)
            )
