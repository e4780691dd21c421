"""Decode steps replayed as captured CUDA graphs (`cuda_graphs: auto`, CUDA with Triton attention).

A decode step of a small model on a GPU is mostly kernel launches: eight layers are a few hundred
small kernels, each a few microseconds of CPU to launch, so the GPU idles between them. A CUDA graph
records the launches of one forward pass once and replays them with one call. Graphs need static
shapes and addresses, so the backbone's forward (embedding to final norm; the LM head runs after it,
on the rows that sample) is captured once per batch size of `batch_sizes(max_num_seqs)` over static
input buffers; a step of n decode rows copies its inputs into the buffers of the smallest captured
size >= n and replays that graph. Rows past n are padding: token 0 at position 0, one key of context
read from block 0, and their key/value written to a scratch slot past the end of the pool that no
sequence owns (the runner allocates it), so they never touch a live sequence's cache.

Steps with a prefill chunk, LoRA rows, or more rows than the largest graph run eagerly, as do all
steps when capture or the load-time check fails (logged once as `llm_cuda_graphs_fallback`): the
check replays a graph over decode rows written into free blocks of the pool and compares its output
with the eager forward's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import structlog
import torch

from backends.torch_llm.kernels.cpu_extension import checked_or_none
from backends.torch_llm.model.attention import AttentionMetadata
from backends.torch_llm.model.llama import LlamaForCausalLM

if TYPE_CHECKING:  # attention_triton imports triton: only where the Triton path was chosen
    from backends.torch_llm.kernels.attention_triton import TritonPagedAttention

log = structlog.get_logger("fleetgate.torch_llm")


def batch_sizes(max_num_seqs: int, largest: int = 128) -> list[int]:
    """The decode batch sizes captured: 1, 2, 4, then every multiple of 8 up to the engine's most
    sequences (at most `largest`; more rows run eagerly)."""
    cap = min(max_num_seqs, largest)
    sizes = [s for s in (1, 2, 4) if s <= cap]
    sizes += list(range(8, cap + 1, 8))
    if cap not in sizes:
        sizes.append(cap)
    return sorted(sizes)


class DecodeGraphs:
    """The captured decode forwards of one model, one per batch size, sharing one memory pool."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        attention: TritonPagedAttention,
        *,
        block_size: int,
        max_blocks_per_seq: int,
        scratch_slot: int,
        sizes: list[int],
    ) -> None:
        self.model, self.kv_caches, self.attention = model, kv_caches, attention
        self.block_size = block_size
        self.sizes = sorted(sizes)
        self.largest = self.sizes[-1]
        dev = kv_caches[0][0].device
        self.device = dev
        width = -(-max_blocks_per_seq // 16) * 16  # the row stride the attention kernel was compiled for
        self.width = width
        self.scratch_slot = scratch_slot
        # ids, positions and slots in one buffer, so a step's inputs reach the GPU in one copy
        self.inputs = torch.zeros(3, self.largest, dtype=torch.long, device=dev)
        self.inputs[2].fill_(scratch_slot)
        self.ids, self.positions, self.slots = self.inputs[0], self.inputs[1], self.inputs[2]
        self.table = torch.zeros(self.largest, width, dtype=torch.int32, device=dev)
        self.lens = torch.ones(self.largest, dtype=torch.int32, device=dev)
        self.replays = 0  # steps served by a graph (tests and metrics read it)
        self.check_errors: list[float] = []  # per checked batch, the worst row's relative error (`check`)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._capture()

    def _meta(self, b: int) -> AttentionMetadata:
        from backends.torch_llm.kernels.attention_triton import TritonDecodes

        decodes = TritonDecodes(self.table[:b], self.lens[:b], [], [])
        return AttentionMetadata(slot_mapping=self.slots[:b], num_decodes=b, decodes=decodes)

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.ids[:b], self.positions[:b], self.kv_caches, self._meta(b))

    @torch.inference_mode()
    def _capture(self) -> None:
        with torch.cuda.device(self.device):  # streams and captures on the model's GPU, not the current one
            side = torch.cuda.Stream(device=self.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up off the capture: lazy inits, kernel compiles
                for b in self.sizes:
                    self._forward(b)
            torch.cuda.current_stream().wait_stream(side)
            pool = None
            for b in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
                graph = torch.cuda.CUDAGraph()
                # thread_local: other engines' threads may allocate or sync on this GPU meanwhile
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self._outputs[b] = self._forward(b)
                pool = graph.pool()
                self._graphs[b] = graph
            torch.cuda.synchronize(self.device)

    def size_for(self, rows: int) -> int | None:
        """The smallest captured batch size holding `rows` decode rows (None: too many)."""
        for b in self.sizes:
            if b >= rows:
                return b
        return None

    @torch.inference_mode()
    def run(
        self,
        ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
    ) -> torch.Tensor:
        """The final hidden states `[n, hidden]` of n decode rows (n <= `largest`)."""
        n = len(ids)
        b = self.size_for(n)
        if b is None:
            raise ValueError(f"{n} decode rows: the largest captured graph holds {self.largest}")
        pad = b - n
        # Only the table's first `used` columns are written: the kernel reads a row's entries up to its
        # context length, so stale columns past them are never read, and a table padded to the full
        # `width` (max_model_len / block_size, thousands of columns) would cost more host time than the
        # step. Padding rows read block 0 (one key) and write the scratch slot (module docstring).
        used = max(len(t) for t in block_tables)
        table = torch.tensor(
            [t + [0] * (used - len(t)) for t in block_tables] + [[0] * used] * pad, dtype=torch.int32
        )
        inputs = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad])
        self.inputs[:, :b].copy_(inputs, non_blocking=True)  # ids, positions, slots: one copy
        self.table[:b, :used].copy_(table, non_blocking=True)
        self.lens[:b].copy_(torch.tensor(context_lens + [1] * pad, dtype=torch.int32), non_blocking=True)
        with torch.cuda.device(self.device):
            self._graphs[b].replay()
        self.replays += 1
        return self._outputs[b][:n]

    @torch.inference_mode()
    def check(self, free_blocks: list[int]) -> str | None:
        """Replay against the eager forward on decode rows placed in `free_blocks` (blocks no
        sequence holds yet): three rows, then as many as the largest graph holds less one (so it
        pads), as far as the free blocks go; every row's context spans two blocks. None when all
        agree."""
        room = len(free_blocks) // 2
        for rows in sorted({min(3, room), min(self.largest - 1, room)}):
            if rows >= 1:
                error = self._check_rows(rows, free_blocks)
                if error is not None:
                    return error
        return None

    def _check_rows(self, rows: int, free_blocks: list[int]) -> str | None:
        bs = self.block_size
        gen = torch.Generator().manual_seed(rows)
        ids = torch.randint(0, self.model.config.vocab_size, (rows,), generator=gen).tolist()
        tables = [[free_blocks[2 * i], free_blocks[2 * i + 1]] for i in range(rows)]
        lens = [bs + 1 + i % bs for i in range(rows)]  # the new token in each row's second block
        slots = [t[1] * bs + n - 1 - bs for t, n in zip(tables, lens, strict=True)]
        positions = [n - 1 for n in lens]
        replayed = self.run(ids, positions, slots, tables, lens).clone()
        # The eager forward over the same padded batch as the graph (padding rows as in `run`), so both
        # run matrix products of one shape: at another row count the library may pick another kernel,
        # whose rounding in bfloat16 over 32 layers alone moved a row by 5 % (Llama-3-8B shape, H100).
        pad = self.size_for(rows) - rows  # type: ignore[operator]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots + [self.scratch_slot] * pad, device=dev),
            num_decodes=rows + pad,
            decodes=self.attention.prepare_decodes(tables + [[0]] * pad, lens + [1] * pad),
        )
        eager = self.model(
            torch.tensor(ids + [0] * pad, device=dev), torch.tensor(positions + [0] * pad, device=dev),
            self.kv_caches, meta,
        )[:rows]  # fmt: skip
        # Per row, the relative error of the whole hidden vector: a row that read another row's inputs
        # or a stale block is off by about its own norm.
        tol = 1e-3 if eager.dtype == torch.float32 else 5e-2
        diff = (replayed.float() - eager.float()).norm(dim=-1)
        worst = (diff / eager.float().norm(dim=-1).clamp_min(1e-6)).max().item()
        self.check_errors.append(worst)
        if not worst <= tol:
            return f"a replayed decode step of {rows} rows differs from the eager one: relative error {worst:.3g}"
        return None


def decode_graphs_or_none(
    model: LlamaForCausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    attention: Any,
    *,
    block_size: int,
    max_blocks_per_seq: int,
    scratch_slot: int,
    max_num_seqs: int,
    free_blocks: list[int],
) -> DecodeGraphs | None:
    """Captured and checked decode graphs, or None (eager steps; one warning says why)."""
    if getattr(attention, "name", None) != "triton" or attention.disabled_reason is not None:
        # info, not a warning: `attention_backend: torch` on CUDA is a choice, not a failure
        log.info("llm_cuda_graphs_off", reason="decode graphs need the Triton attention kernel")
        return None

    def capture() -> DecodeGraphs:
        return DecodeGraphs(
            model, kv_caches, attention, block_size=block_size, max_blocks_per_seq=max_blocks_per_seq,
            scratch_slot=scratch_slot, sizes=batch_sizes(max_num_seqs),
        )  # fmt: skip

    def check(graphs: DecodeGraphs) -> str | None:
        if attention.disabled_reason is not None:
            return f"the attention kernel fell back while capturing: {attention.disabled_reason}"
        return graphs.check(free_blocks)

    # a kernel error while capturing must fail the capture, not switch the attention to its
    # fallback for good (the fallback cannot run inside a graph). The graphs split contexts over more
    # programs (see `TritonPagedAttention.split_contexts`), and so does the eager forward the check
    # compares them with: the same kernels on both sides, so bf16 rounding cannot tell them apart.
    strict, attention.strict, attention.split_contexts = attention.strict, True, True
    try:
        graphs = checked_or_none(capture, check, "llm_cuda_graphs_fallback")
    finally:
        attention.strict, attention.split_contexts = strict, False
    if graphs is not None:
        graphs.replays = 0  # the check's replays are not served steps
    return graphs
