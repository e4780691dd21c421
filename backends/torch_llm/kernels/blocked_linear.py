"""Float32 linear layers on CPU through fleetgate's own kernel over a blocked weight layout
(`linear_backend: blocked`, the default on CPU for float32 where it builds).

Measured on this project's 2-core CPU (AVX2), one decoder's worth of projections of the bench's
Llama (h512, 8 layers) plus its LM head, in one run: 8.7 ms with oneDNN's packed linears at 1 row
and 5.9 ms here (0.68x); 18.2 ms and 14.4 ms at 16 rows (0.79x); 346 and 318 ms at 512 rows (another
run, 0.92x). See
`blocked_linear_cpu.cpp` for the layout and the micro-kernel. The blocked weight replaces the
original (no second copy). Results equal `F.linear`'s to float32 rounding (another summation order).

The kernel is built once per install by `fleetgate build-kernels` (`cpu_extension`, like the other
CPU kernels) and only loaded here; `kernel_or_none` returns it only when it is built and agrees with
`F.linear` on random inputs, so that the caller can fall back to oneDNN.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from backends.torch_llm.kernels.cpu_extension import CpuKernel, checked_or_none, load_built

BLOCK = 16  # output columns per block (the kernel's register tile width)
KERNEL = CpuKernel(
    prefix="fleetgate_blocked_linear",
    source=pathlib.Path(__file__).with_name("blocked_linear_cpu.cpp"),
    functions=("blocked_linear",),
    cflags=("-O3", "-march=native", "-fopenmp"),
)


@functools.cache
def load_kernel() -> Any:
    """The built extension module (`KernelNotBuilt` when this install has not built it)."""
    return load_built(KERNEL)


def kernel_or_none() -> Any | None:
    """The kernel when it is built and matches `F.linear`, else None (one warning logged)."""
    return checked_or_none(load_kernel, probe, "llm_blocked_linear_fallback")


def probe(kernel: Any) -> str | None:
    """The kernel against `F.linear` on shapes that exercise every tile height, a partial last
    block and a bias; None when all agree."""
    gen = torch.Generator().manual_seed(0)
    for rows, out_features, bias in ((1, 48, False), (7, 37, True), (13, 16, False)):
        linear = nn.Linear(24, out_features, bias=bias)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(out_features, 24, generator=gen))
            if bias:
                linear.bias.copy_(torch.randn(out_features, generator=gen))
        x = torch.randn(rows, 24, generator=gen)
        want = F.linear(x, linear.weight, linear.bias)
        got = BlockedLinear(linear, kernel)(x)
        err = (got - want).abs().max().item()
        if got.shape != want.shape or not err <= 1e-5 * max(1.0, want.abs().max().item()):
            return f"blocked linear disagrees with F.linear at {rows}x{out_features}: max abs error {err:.3g}"
    return None


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N/16), K, 16]: each block's 16 output columns side by side per k, zero rows
    padding N to whole blocks."""
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded.view(blocks, BLOCK, k).transpose(1, 2).contiguous()


class BlockedLinear(nn.Module):
    """`y = x W^T + b` with W in the blocked layout; `x` is [..., in] float32."""

    def __init__(self, linear: nn.Linear, kernel: Any) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self._kernel = kernel
        self.register_buffer("blocked_weight", block_weight(linear.weight.detach().float()))
        bias = torch.zeros(0)
        if linear.bias is not None:
            bias = torch.zeros(self.blocked_weight.shape[0] * BLOCK)
            bias[: self.out_features] = linear.bias.detach().float()
        self.register_buffer("padded_bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        out = self._kernel.blocked_linear(rows, self.blocked_weight, self.padded_bias, self.out_features)
        return out.view(*x.shape[:-1], self.out_features)
