"""Choose the paged-attention implementation for a device, and check a fast one before trusting it.

`auto`: the Triton decode kernel on CUDA, the C++ decode kernel on CPU (`attention_cpu`). `triton`
asks for the Triton kernel anywhere (on CPU it only runs under `TRITON_INTERPRET=1`, which is how
tests exercise it), `cpu_kernel` for the C++ one; `torch` always uses gather + SDPA. Before a kernel
is used it is *probed*: it runs once on random data with the model's real head layout, block size
and dtype, and must agree with gather + SDPA. An import error (no triton, no compiler), a compile or
launch error, or a wrong answer logs one warning (`llm_attention_fallback`) and the engine uses
gather + SDPA instead; it never fails to load for it.
"""

from __future__ import annotations

import sys
from typing import Literal

import structlog
import torch

from backends.torch_llm.model.attention import AttentionMetadata, PagedAttention, TorchPagedAttention

log = structlog.get_logger(__name__)

AttentionBackend = Literal["auto", "torch", "triton", "cpu_kernel"]


def make_attention(
    device: torch.device,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    block_size: int,
    dtype: torch.dtype,
    backend: AttentionBackend = "auto",
) -> PagedAttention:
    """The attention implementation for `device` (see the module docstring for the rules)."""
    shape = (num_heads, num_kv_heads, head_dim)
    fallback = TorchPagedAttention(*shape, block_size=block_size, device=device)
    want_triton = backend == "triton" or (backend == "auto" and device.type == "cuda")
    want_cpu_kernel = device.type == "cpu" and backend in ("auto", "cpu_kernel")
    if want_cpu_kernel:
        return _cpu_kernel_or(fallback, shape, block_size, dtype)
    if not want_triton:
        return fallback
    if "tensorflow" in sys.modules and "triton" not in sys.modules:
        # Loading triton's native library after TensorFlow's aborts the whole process (triton 3.9,
        # TensorFlow 2.21; the other order works): a gateway that also serves a tfserving deployment
        # keeps gather + SDPA rather than risk it.
        log.warning(
            "llm_attention_fallback",
            backend="torch",
            reason="TensorFlow is loaded in this process; importing triton after it aborts the process",
            device=str(device),
        )
        return fallback
    try:
        from backends.torch_llm.kernels.attention_triton import TritonPagedAttention

        fast = TritonPagedAttention(*shape, block_size=block_size, device=device)
        error = probe(fast, fallback, dtype)
    except Exception as exc:  # noqa: BLE001 - no triton, no driver, a compile error: all fall back
        error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        log.warning("llm_attention_fallback", backend="torch", reason=error[:500], device=str(device))
        return fallback
    fast.strict = False  # from now on a failing launch falls back instead of failing the step
    return fast


def _cpu_kernel_or(
    fallback: TorchPagedAttention, shape: tuple[int, int, int], block_size: int, dtype: torch.dtype
) -> PagedAttention:
    """The C++ decode kernel when it builds and agrees with gather + SDPA, else `fallback`."""
    try:
        from backends.torch_llm.kernels.attention_cpu import CpuPagedAttention

        fast = CpuPagedAttention(*shape, block_size=block_size, device=torch.device("cpu"))
        error = probe(fast, fallback, dtype)
    except Exception as exc:  # noqa: BLE001 - no compiler, a build error: gather + SDPA serves
        error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        log.warning("llm_attention_fallback", backend="torch", reason=error[:500], device="cpu")
        return fallback
    return fast


def probe(fast: PagedAttention, reference: TorchPagedAttention, dtype: torch.dtype) -> str | None:
    """Run both implementations' decode path on the same random paged data; None when they agree.

    Three sequences (1 key, one block plus one, three blocks minus one) in a shuffled pool, so the
    block-table indirection, partial last blocks and the single-key case are all exercised.
    """
    bs, dev = reference.block_size, reference.device
    h, kvh, d = reference.num_heads, reference.num_kv_heads, reference.head_dim
    lengths = [1, bs + 1, 3 * bs - 1]
    num_blocks = sum(-(-n // bs) for n in lengths) + 2
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lengths:
        tables.append(order[used : used + -(-n // bs)])
        used += len(tables[-1])
    caches = [torch.randn(num_blocks * bs, kvh, d, generator=gen).to(dev, dtype) for _ in range(4)]
    # q as the model passes it: the first heads of a [T, H + KVH, D] tensor (q and k are rotated
    # together), so the row stride the kernel is compiled for here is the one it meets when serving
    q = torch.randn(len(lengths), h + kvh, d, generator=gen).to(dev, dtype)[:, :h]
    new_kv = torch.randn(len(lengths), kvh, d, generator=gen).to(dev, dtype)
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lengths, strict=True)])

    def decode(impl: PagedAttention, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        kc.copy_(caches[0])
        vc.copy_(caches[1])
        meta = AttentionMetadata(
            slot_mapping=slots.to(dev),
            num_decodes=len(lengths),
            decodes=impl.prepare_decodes(tables, lengths),
        )
        return impl(q, new_kv, new_kv, kc, vc, meta).float()

    expected = decode(reference, *caches[2:])
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    # the Triton kernel also has a split-context variant, used inside captured decode graphs
    variants = (False, True) if hasattr(fast, "split_contexts") else (None,)
    for split in variants:
        if split is not None:
            fast.split_contexts = split  # type: ignore[attr-defined]
        try:
            err = (decode(fast, *caches[:2]) - expected).abs().max().item()
        finally:
            if split is not None:
                fast.split_contexts = False  # type: ignore[attr-defined]
        if not err <= tol:
            which = " (contexts split)" if split else ""
            return f"paged decode kernel{which} disagrees with gather + SDPA: max abs error {err:.3g} > {tol}"
    return None
