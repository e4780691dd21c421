"""Fused decoder-layer steps on CPU (RMSNorm, residual add + RMSNorm, rotary, SiLU-and-multiply).

Between its matmuls a decoder layer runs about thirty small torch ops (the norms' pow, mean, rsqrt
and products, rotary's slices, negation and concatenation, the activation, the residual adds); on
CPU each pays a dispatch and a temporary, and at a decode step's 1-16 rows that overhead, not the
arithmetic, is their cost: measured on this project's 2-core CPU, 2.1 ms of a 16.5 ms batch-1 step
and 4 ms of a 33 ms 16-row step. `fused_ops_cpu.cpp` does each chain in one pass with the
reference's arithmetic (see the file for what is bit-identical).

The kernels are built once per install by `fleetgate build-kernels` (`cpu_extension`, as with the
paged decode kernel) and only loaded here. `cpu_kernels_or_none` returns them only when they are
built and agree with the torch ops on random inputs; otherwise it logs one warning
(`llm_fused_ops_fallback`, naming the build command where they are not built) and the model keeps
the torch ops.
"""

from __future__ import annotations

import functools
import pathlib
from typing import Any

import torch

from backends.torch_llm.kernels.cpu_extension import CpuKernel, checked_or_none, load_built

KERNEL = CpuKernel(
    prefix="fleetgate_fused_ops",
    source=pathlib.Path(__file__).with_name("fused_ops_cpu.cpp"),
    functions=("rms_norm", "add_rms_norm_", "rotary_", "silu_mul"),
    # no contraction of a * b + c into an FMA: the reference rounds the product first;
    # no trapping math (results unchanged, exceptions unobserved) lets exp's clamps vectorize
    cflags=("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"),
)


@functools.cache
def load_kernels() -> Any:
    """The built extension module (`KernelNotBuilt` when this install has not built it)."""
    return load_built(KERNEL)


def cpu_kernels_or_none(dtype: torch.dtype) -> Any | None:
    """The fused kernels when they build and agree with the torch ops for `dtype`, else None."""
    return checked_or_none(load_kernels, lambda kernels: probe(kernels, dtype), "llm_fused_ops_fallback")


def probe(kernels: Any, dtype: torch.dtype) -> str | None:
    """Each kernel against the torch ops it replaces, on random rows; None when all agree."""
    from backends.torch_llm.model.llama import RMSNorm, apply_rotary

    gen = torch.Generator().manual_seed(0)
    rows, hidden, heads, kv_heads, head_dim = 5, 96, 3, 1, 32

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    norm = RMSNorm(hidden, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(rand(hidden))
    x, residual = rand(rows, hidden), rand(rows, hidden)
    checks = [("rms_norm", kernels.rms_norm(x, norm.weight, norm.eps), norm(x))]
    fused_x, fused_residual = x.clone(), residual.clone()
    kernels.add_rms_norm_(fused_x, fused_residual, norm.weight, norm.eps)
    checks += [
        ("add_rms_norm_ residual", fused_residual, residual + x),
        ("add_rms_norm_", fused_x, norm(residual + x)),
    ]
    width = (heads + 2 * kv_heads) * head_dim
    qkv = rand(rows, width)
    angles = torch.rand(rows, head_dim // 2, generator=gen) * 6.0
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    rotated = heads + kv_heads
    expected = apply_rotary(
        qkv[:, : rotated * head_dim].view(rows, rotated, head_dim), cos[:, None], sin[:, None]
    )
    fused = qkv.clone()
    kernels.rotary_(fused, cos, sin, rotated, head_dim)
    checks += [
        ("rotary_", fused[:, : rotated * head_dim], expected.reshape(rows, -1)),
        ("rotary_ (values untouched)", fused[:, rotated * head_dim :], qkv[:, rotated * head_dim :]),
    ]
    gate_up = rand(rows, 2 * hidden)
    gate, up = gate_up.chunk(2, dim=-1)
    checks.append(("silu_mul", kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name, got, want in checks:
        err = (got.float() - want.float()).abs().max().item()
        if not err <= tol * max(1.0, want.float().abs().max().item()):
            return f"fused {name} disagrees with the torch ops: max abs error {err:.3g}"
    return None
