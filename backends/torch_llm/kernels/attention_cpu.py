"""Paged decode attention on CPU without the gather: a small C++ kernel built at install.

Gather + SDPA (`TorchPagedAttention`) copies every decode row's context out of the block pool before
attending, so the keys and values cross memory three times per layer; at 16 sequences of a few
hundred tokens that copy was half of a decode step (torch.profiler: `index_select` 50 %, SDPA 20 %).
`CpuPagedAttention` reads them once, in place, through the block tables
(`paged_decode_cpu.cpp`). Prefill chunks keep SDPA (their gather is amortised over many queries).

The kernel is compiled once per install by `fleetgate build-kernels` (`cpu_extension`: tens of
seconds, into the install's own directory, keyed by the source, torch, the CPU model and the flags, as
it is built for the host's instruction set); an engine only loads it. Where it is not built (no C++
compiler, the command not run) or does not agree with gather + SDPA, `attention_select` logs one
warning and uses gather + SDPA.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import torch

from backends.torch_llm.kernels.cpu_extension import CpuKernel, load_built
from backends.torch_llm.model.attention import TorchPagedAttention

KERNEL = CpuKernel(
    prefix="fleetgate_paged_decode",
    source=pathlib.Path(__file__).with_name("paged_decode_cpu.cpp"),
    functions=("paged_decode",),
    # fast-math lets the compiler vectorize the dot-product reductions and exp (1.6x here);
    # the kernel avoids infinities, which fast-math assumes away
    cflags=("-O3", "-march=native", "-fopenmp", "-ffast-math"),
)


@functools.cache
def load_kernel() -> Any:
    """The built extension module (`KernelNotBuilt` when this install has not built it)."""
    return load_built(KERNEL)


class CpuPagedAttention(TorchPagedAttention):
    """Decode rows through the C++ kernel; prefill chunks through SDPA (inherited)."""

    name = "cpu_kernel"

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, *, block_size: int, device: torch.device
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size=block_size, device=device)
        self._kernel = load_kernel()

    def prepare_decodes(
        self, block_tables: list[list[int]], context_lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables padded to the longest `[N, max_blocks]` and the context lengths `[N]`."""
        width = max(len(t) for t in block_tables)
        tables = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.long)
        return tables, torch.tensor(context_lens, dtype=torch.long)

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decodes: Any, out: torch.Tensor
    ) -> None:
        tables, lens = decodes
        n = lens.shape[0]
        rows = out.narrow(0, 0, n)
        self._kernel.paged_decode(
            q.narrow(0, 0, n).contiguous(), k_cache, v_cache, tables, lens, self.scale, self.block_size, rows
        )
