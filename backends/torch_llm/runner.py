"""Runs one scheduled step through the model: builds the flattened batch, owns the KV cache tensors."""

from __future__ import annotations

import torch

from backends.torch_llm.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from backends.torch_llm.model import LlamaForCausalLM
from backends.torch_llm.sequence import Sequence


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of keys + values of one block across all layers."""
    cfg = model.config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class ModelRunner:
    """Owns the paged KV cache and executes steps.

    Args:
        model: the loaded model (on `device`).
        num_blocks: blocks in the KV pool.
        block_size: tokens per block.
    """

    def __init__(self, model: LlamaForCausalLM, *, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = model.config
        shape = (num_blocks * block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]

    def _slots(self, block_table: list[int], start: int, stop: int) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in range(start, stop)]

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute the scheduled tokens (writing their KV) and the logits of sequences that need a token.

        Returns:
            (logits [N, vocab] float32, the N sequences whose last token was computed, in row order).
        """
        # Decodes (one new token) first, so they form one contiguous batched-attention block.
        # Sorted by context length so each padded decode group holds similar lengths.
        decodes = sorted(((s, n) for s, n in scheduled if n == 1), key=lambda x: x[0].num_computed_tokens)
        prefills = [(s, n) for s, n in scheduled if n != 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        chunks: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        dev = self.device
        for seq, n in decodes + prefills:
            start = seq.num_computed_tokens
            row = len(ids)
            ids.extend(seq.token_ids(start, start + n))
            positions.extend(range(start, start + n))
            slots.extend(self._slots(seq.block_table, start, start + n))
            if n != 1:
                ctx_slots = self._slots(seq.block_table, 0, start + n) if start else slots[row:]
                chunks.append(PrefillChunk(row, n, torch.tensor(ctx_slots, dtype=torch.long, device=dev)))
            if start + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampled.append(seq)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decodes=self._decode_groups([s for s, _ in decodes]),
            prefills=chunks,
        )
        hidden = self.model(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )
        if not sampled:
            return torch.empty(0, self.model.config.vocab_size), []
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return self.model.logits(hidden.index_select(0, rows)), sampled

    def _decode_groups(self, seqs: list[Sequence]) -> list[DecodeGroup]:
        """Cut length-sorted decodes into groups whose padding is at most ~25% of their real keys."""
        groups: list[DecodeGroup] = []
        start = 0
        while start < len(seqs):
            end = start + 1
            total = seqs[start].num_computed_tokens + 1
            while end < len(seqs):
                longest = seqs[end].num_computed_tokens + 1
                if longest * (end - start + 1) > 1.25 * (total + longest) and end - start >= 4:
                    break
                total += longest
                end += 1
            slots, mask = self._decode_context(seqs[start:end])
            groups.append(DecodeGroup(start, slots, mask))
            start = end
        return groups

    def _decode_context(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded slot indices `[B, max_ctx]` and key mask `[B, 1, 1, max_ctx]` of decode contexts."""
        bs, dev = self.block_size, self.device
        lengths = [s.num_computed_tokens + 1 for s in seqs]
        max_blocks = max(len(s.block_table) for s in seqs)
        table = torch.tensor(
            [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs], dtype=torch.long
        )
        slot_grid = (table.unsqueeze(-1) * bs + torch.arange(bs)).view(len(seqs), -1)  # [B, blocks*bs]
        max_ctx = max(lengths)
        slot_grid = slot_grid[:, :max_ctx]
        mask = torch.arange(max_ctx).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)  # [B, C]
        return slot_grid.to(dev), mask.view(len(seqs), 1, 1, max_ctx).to(dev)
