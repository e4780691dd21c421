"""Runs one scheduled step through the model: builds the flattened batch, owns the KV cache tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from backends.torch_llm.kernels.attention_select import AttentionBackend, make_attention
from backends.torch_llm.lora.pool import LoRAPool
from backends.torch_llm.model.attention import AttentionMetadata, PagedAttention, PrefillChunk
from backends.torch_llm.model.llama import LlamaForCausalLM
from backends.torch_llm.sequence import Sequence

if TYPE_CHECKING:
    from backends.torch_llm.kernels.cuda_graphs import DecodeGraphs


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
        attention: which paged-attention implementation to use ("auto": by device, see
            `attention_select`); the chosen one is `self.attention`.
        lora: the engine's adapters (None: the model serves no adapters and has no LoRA layers).
        spare_block: allocate one block past the pool's `num_blocks` that no sequence ever owns
            (the scratch slot the padding rows of captured decode graphs write to).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        num_blocks: int,
        block_size: int,
        attention: AttentionBackend = "auto",
        lora: LoRAPool | None = None,
        spare_block: bool = False,
    ) -> None:
        self.model = model
        self.lora = lora
        self.block_size = block_size
        self.num_blocks = num_blocks
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        cfg = model.config
        self.attention: PagedAttention = make_attention(
            self.device, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            block_size=block_size, dtype=self.dtype, backend=attention,
        )  # fmt: skip
        model.set_attention(self.attention)
        shape = ((num_blocks + int(spare_block)) * block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self._spare_block = spare_block
        #: captured decode steps (CUDA; `use_decode_graphs`), or None: every step runs eagerly
        self.graphs: DecodeGraphs | None = None

    def use_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> bool:
        """Capture and check CUDA graphs of decode steps (see `cuda_graphs`); False when they are
        not used (not CUDA, LoRA layers, no spare block, or capture or check failed: logged)."""
        if self.device.type != "cuda" or self.lora is not None or not self._spare_block:
            return False
        from backends.torch_llm.kernels.cuda_graphs import decode_graphs_or_none

        self.graphs = decode_graphs_or_none(
            self.model, self.kv_caches, self.attention, block_size=self.block_size,
            max_blocks_per_seq=-(-max_model_len // self.block_size),
            scratch_slot=self.num_blocks * self.block_size, max_num_seqs=max_num_seqs,
            free_blocks=list(range(min(256, self.num_blocks))),  # none is owned before serving
        )  # fmt: skip
        return self.graphs is not None

    def _graph_fits(self, num_decodes: int, prefills: list, adapted: list) -> bool:
        """Whether a step runs as a captured graph: decodes only, no adapter, a graph that holds
        them, and the attention kernel the graphs captured still in use."""
        graphs = self.graphs
        return (
            graphs is not None
            and num_decodes > 0
            and not prefills
            and not adapted
            and self.attention.disabled_reason is None  # type: ignore[attr-defined]
            and graphs.size_for(num_decodes) is not None
        )

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
        # Sorted by context length so each padded decode group (gather + SDPA path) holds similar lengths.
        decodes = sorted(((s, n) for s, n in scheduled if n == 1), key=lambda x: x[0].num_computed_tokens)
        prefills = [(s, n) for s, n in scheduled if n != 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        chunks: list[PrefillChunk] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        adapted: list[tuple[int, int, str]] = []  # (first row, rows, adapter) of adapter requests
        dev = self.device
        for seq, n in decodes + prefills:
            start = seq.num_computed_tokens
            row = len(ids)
            if seq.adapter is not None:
                adapted.append((row, n, seq.adapter))
            ids.extend(seq.token_ids(start, start + n))
            positions.extend(range(start, start + n))
            slots.extend(self._slots(seq.block_table, start, start + n))
            if n != 1:
                used_blocks = seq.block_table[: -(-(start + n) // self.block_size)]
                chunks.append(PrefillChunk(row, n, start + n, torch.tensor(used_blocks, device=dev)))
            if start + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sampled.append(seq)
        tables = [s.block_table for s, _ in decodes]
        lens = [s.num_computed_tokens + 1 for s, _ in decodes]  # keys each decode row attends to
        if self._graph_fits(len(decodes), prefills, adapted):
            hidden = self.graphs.run(ids, positions, slots, tables, lens)  # type: ignore[union-attr]
        else:
            hidden = self._forward(ids, positions, slots, tables, lens, chunks, adapted)
        if not sampled:
            return torch.empty(0, self.model.config.vocab_size), []
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return self.model.logits(hidden.index_select(0, rows)), sampled

    def _forward(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
        lens: list[int],
        chunks: list[PrefillChunk],
        adapted: list[tuple[int, int, str]],
    ) -> torch.Tensor:
        """The eager forward of a step's flattened rows (writing their KV): final hidden states.
        Decode row i reads `lens[i]` keys through `tables[i]`."""
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=len(lens),
            decodes=self.attention.prepare_decodes(tables, lens) if lens else None,
            prefills=chunks,
        )
        if adapted:
            self._set_lora_rows(adapted)
        try:
            hidden = self.model(
                torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev),
                self.kv_caches,
                meta,
            )
        finally:
            if adapted:
                self._clear_lora_rows()
        return hidden

    def _set_lora_rows(self, adapted: list[tuple[int, int, str]]) -> None:
        """Tell the LoRA layers which rows of this step use which adapter (paging adapters in)."""
        if self.lora is None:
            raise RuntimeError("a request names an adapter but this engine has no LoRA layers")
        names = {name for _, _, name in adapted}
        slots = self.lora.activate(names)
        batch = self.lora.batch
        singles = [(row, slots[name]) for row, n, name in adapted if n == 1]
        if singles:
            batch.decode_rows = torch.tensor([r for r, _ in singles], dtype=torch.long, device=self.device)
            batch.decode_slots = torch.tensor([s for _, s in singles], dtype=torch.long, device=self.device)
        batch.chunks = [(row, row + n, slots[name]) for row, n, name in adapted if n != 1]
        batch.rank = self.lora.rank_of(names)

    def _clear_lora_rows(self) -> None:
        batch = self.lora.batch if self.lora is not None else None
        if batch is not None:
            batch.decode_rows = batch.decode_slots = None
            batch.chunks = []
            batch.rank = 0
