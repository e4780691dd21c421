"""Batched LoRA: one base matmul for every row of a step plus each row's own low-rank update.

Every adaptable projection is wrapped in `LoRALinear`, which owns the device slots of that
projection: `a_slots` [S, in, R] (A transposed) and `b_slots` [S, R, out], one slot per adapter
resident on the device (slot 0 is never used, it means "the base model"), zero-padded to the
deployment's largest rank R. A step's `LoRABatch` says which rows use which slot:

- single-token rows (decodes) are gathered and updated with two batched matmuls over their slots
  (the BGMV of Punica / S-LoRA): no per-adapter sub-batch, whatever the mix of adapters;
- a prompt chunk (a run of rows of one sequence) shares its adapter, so it takes two plain matmuls
  against that slot's matrices, which keeps memory at the chunk's size rather than rows x rank x out.

Rows of the base model cost nothing extra; a step without adapters skips the LoRA path entirely.
The update is added as PEFT computes it, `base(x) + (x A^T) B^T * scaling`, so greedy outputs match
PEFT's token for token in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

#: decode rows whose adapter matrices are gathered at once (bounds the gather's temporary memory)
GATHER_ROWS = 64


@dataclass
class LoRABatch:
    """Which rows of the current step use which adapter slot (set by the runner before a forward)."""

    #: rows of single-token sequences that use an adapter, and their slots
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    #: (first row, end row, slot) of each multi-token chunk that uses an adapter
    chunks: list[tuple[int, int, int]] = field(default_factory=list)
    #: the largest rank among the slots this step uses (the padded rank is never computed past it)
    rank: int = 0

    @property
    def active(self) -> bool:
        return self.rank > 0 and (self.decode_rows is not None or bool(self.chunks))


class LoRALinear(nn.Module):
    """A projection with per-row LoRA updates; `base` is any module computing x -> x W^T (+ b).

    Args:
        base: the projection (an `nn.Linear` or a quantized linear).
        in_features / out_features: its shape.
        num_slots: adapters resident on the device at once, plus one (slot 0 is the base model).
        max_rank: the largest rank an adapter may have.
        batch: the step's row-to-slot map, shared by every wrapped projection of the model.
    """

    def __init__(
        self,
        base: nn.Module,
        in_features: int,
        out_features: int,
        *,
        num_slots: int,
        max_rank: int,
        batch: LoRABatch,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = in_features, out_features
        ref = next(base.parameters(), None)
        ref = ref if ref is not None else next(base.buffers())
        dtype = ref.dtype if ref.is_floating_point() else torch.float32
        self.register_buffer(
            "a_slots", torch.zeros(num_slots, in_features, max_rank, dtype=dtype, device=ref.device)
        )
        self.register_buffer(
            "b_slots", torch.zeros(num_slots, max_rank, out_features, dtype=dtype, device=ref.device)
        )
        self.register_buffer("scalings", torch.zeros(num_slots, dtype=dtype, device=ref.device))
        self.batch = batch

    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor, float] | None) -> None:
        """Write one adapter's (A [r, in], B [out, r], scaling) into `slot`; None clears the slot."""
        self.a_slots[slot].zero_()
        self.b_slots[slot].zero_()
        if weights is None:
            self.scalings[slot] = 0.0
            return
        a, b, scaling = weights
        rank = a.shape[0]
        self.a_slots[slot, :, :rank].copy_(a.t())
        self.b_slots[slot, :rank, :].copy_(b.t())
        self.scalings[slot] = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if not batch.active:
            return y
        r = batch.rank
        if batch.decode_rows is not None:
            # gathered in groups of GATHER_ROWS: the copies are [rows, in, r] and [rows, r, out],
            # which for a large batch of a large model would otherwise need hundreds of MB
            for start in range(0, batch.decode_rows.shape[0], GATHER_ROWS):
                rows = batch.decode_rows[start : start + GATHER_ROWS]
                slots = batch.decode_slots[start : start + GATHER_ROWS]
                a = self.a_slots[:, :, :r].index_select(0, slots)  # [n, in, r]
                b = self.b_slots[:, :r, :].index_select(0, slots)  # [n, r, out]
                h = torch.bmm(x.index_select(0, rows).unsqueeze(1), a)  # [n, 1, r]
                delta = torch.bmm(h, b).squeeze(1) * self.scalings.index_select(0, slots).unsqueeze(1)
                y.index_add_(0, rows, delta)
        for start, end, slot in batch.chunks:
            delta = (x[start:end] @ self.a_slots[slot, :, :r]) @ self.b_slots[slot, :r, :]
            y[start:end] += delta * self.scalings[slot]
        return y
