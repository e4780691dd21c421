"""Weight-only int8 quantization of the decoder's projections (`options.quantization: int8`).

Every `nn.Linear` of the decoder (q/k/v/o, gate/up/down) becomes an `Int8Linear`: int8 weights
`[out, in]` plus one float scale per output channel (symmetric, round-to-nearest, codes in
[-127, 127]), so `W ~= q * scale[:, None]`. Activations stay in floating point; only the weights
shrink (4x against float32, 2x against bfloat16), which is what bounds batch-1 decoding.

Integration is two calls, right after `load_model` (and before LoRA layers wrap the projections):

    check_quantization(options.quantization, device.type)   # ValueError for unknown methods
    quantize_linears(model)                                  # returns how many were replaced

How a forward runs (`Int8Linear.path_for` names the path; measured with torch 2.13 on an AVX-512
CPU, one thread, see bench/bench_llm_int8.py):

- "pack": `aten._weight_int8pack_mm(x [M, K], q [N, K] int8, scale [N])`, which wants a 2-D
  contiguous input whose dtype equals the scales' dtype (float32, bfloat16 or float16). Only its
  bfloat16 kernel is vectorised: at M = 1 it reads the int8 weights once and beats a bfloat16
  GEMM; its float32 and float16 kernels are scalar (10-40x slower than a float32 GEMM), and its
  time grows linearly with M, so past `PACK_MAX_ROWS` rows (more for large weights) a dequantised
  GEMM is faster. The AVX-512 bfloat16 kernel also trusts its inputs blindly: with
  `in_features % 16 != 0` or an unaligned input it returns wrong values or segfaults, so such
  calls take "dequant" (see `Int8Linear._pack_safe`).
- "pack_bf16": a float32 input is rounded to bfloat16, run through the bfloat16 kernel, and the
  result widened back to float32. This is the float32 CPU path: 1.4-3x faster than the float32
  GEMM at decode sizes, and faster than dequantising to float32 (which writes a full float32 copy of
  every weight on every call) at every M measured on 4096 x 4096. Rounding the activations to
  bfloat16 adds a relative error of at most 2^-9 per element, well under the int8 weight error
  (about 1/254 of a row's largest weight); the kernel accumulates in float32 and computes each row
  independently, so results do not depend on how many rows a step has.
- "dequant": `F.linear(x, q.to(x.dtype)) * scale (+ bias)`: CUDA, float16, and bfloat16 steps of
  more rows than the kernel's limit on CPU. For float16 the scale is applied to the weight before the
  matmul instead (`q * scale` first), since a float16 `x @ q^T` with |q| up to 127 can overflow.
  On CUDA this is correct but not fast (it materialises the dequantised weight each call).

Memory is what int8 saves everywhere; speed depends on the path and the machine: bench/results/
llm_int8*.json (on the bench's 8-layer model the int8 decoder also fits this CPU's L3, the float one
does not, which accounts for part of the batch-1 gain).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

SUPPORTED = ("int8",)

Kernel = Literal["auto", "pack", "pack_bf16", "dequant"]
KERNELS: tuple[str, ...] = ("auto", "pack", "pack_bf16", "dequant")

#: bfloat16 steps with at most this many rows use the int8 kernel on CPU, larger ones dequantise.
#: Measured (one thread, weights not cache-resident): the kernel's time grows with the rows while
#: dequantising costs one pass over the weight, so the crossover is near 10 rows for projections up
#: to 2048 x 2048, but past 48 rows from 4096 x 4096 up, where the dequantised copy (32 MB and more)
#: is a fresh page-faulted allocation on every call.
PACK_MAX_ROWS = 8
PACK_MAX_ROWS_LARGE = 48
LARGE_WEIGHT = 1 << 24  # elements (4096 x 4096)

_PACK_MM = getattr(torch.ops.aten, "_weight_int8pack_mm", None)
_ALIGN = 64  # bytes; torch's CPU allocator aligns every allocation to 64


def check_quantization(name: str | None, device_type: str) -> None:
    """Refuse a quantization method this engine cannot run (None: no quantization, always fine).

    Raises:
        ValueError: unknown method, or a device type with no int8 path.
    """
    if name is None:
        return
    if name not in SUPPORTED:
        raise ValueError(
            f"quantization {name!r} is not supported by the torch_llm engine; "
            f"supported: {', '.join(repr(s) for s in SUPPORTED)} (weight-only int8, per output channel)"
        )
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"quantization {name!r} runs on cpu and cuda, not on {device_type!r}")


def _quantize_rows(weight: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 codes and scales: `weight ~= q * scale[:, None]`."""
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=1)
    raw = amax / 127.0
    # Scales are made exactly representable in bfloat16 (float32 storage for float32 models), so
    # the bfloat16 kernel sees the very scale the codes were rounded against. Rounding the scale to
    # nearest moves it by at most 2^-9, so |w| / scale <= 127.25 and the clamp below never bites
    # by more than a quarter step.
    scale = raw.to(torch.bfloat16 if scale_dtype == torch.float32 else scale_dtype)
    # All-zero rows (and scales below the dtype's range) get scale 1: their codes are all 0.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype)
    q = torch.round(w / scale.to(torch.float32).unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear(nn.Module):
    """`y = x @ (q * scale[:, None])^T + bias` with int8 `q`; a drop-in for a bias-free/biased `nn.Linear`.

    Buffers: `scale` [out] (the compute dtype; registered first so modules that probe a wrapped
    projection's first tensor for its dtype, like `LoRALinear`, see a float), `weight_int8`
    [out, in] int8, and for float32 models `scale_bf16` (the same values, for the bfloat16 kernel).
    `kernel` forces a path ("auto": by device, dtype and rows; see the module docstring).
    """

    def __init__(
        self,
        weight_int8: torch.Tensor,
        scale: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        kernel: Kernel = "auto",
    ) -> None:
        super().__init__()
        if weight_int8.dtype != torch.int8 or weight_int8.dim() != 2:
            raise ValueError("weight_int8 must be a 2-D int8 tensor [out, in]")
        if scale.shape != (weight_int8.shape[0],) or not scale.is_floating_point():
            raise ValueError(f"scale must be a float tensor of shape [{weight_int8.shape[0]}]")
        self.out_features, self.in_features = weight_int8.shape
        self.register_buffer("scale", scale)
        self.register_buffer("weight_int8", weight_int8.contiguous())
        bf16 = None if scale.dtype == torch.bfloat16 else scale.to(torch.bfloat16)
        self.register_buffer("scale_bf16", bf16, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.kernel: Kernel = kernel

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, kernel: Kernel = "auto") -> Int8Linear:
        """Quantize `linear` per output channel; the scale (and bias) keep the linear's dtype."""
        weight = linear.weight
        q, scale = _quantize_rows(weight, weight.dtype)
        return cls(q, scale, linear.bias, kernel=kernel)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`q * scale[:, None]` as a dense `[out, in]` tensor (tests, debugging)."""
        return (self.weight_int8.to(torch.float32) * self.scale.to(torch.float32).unsqueeze(1)).to(dtype)

    def weight_bytes(self) -> int:
        """Bytes of this layer's weight tensors (codes, scales, bias)."""
        tensors = [self.weight_int8, self.scale, self.scale_bf16, self.bias]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def path_for(self, x: torch.Tensor) -> str:
        """The path `forward(x)` takes: "pack", "pack_bf16" or "dequant".

        A forced pack path that the kernel cannot take safely (see `_pack_safe`) runs "dequant".
        """
        path = self.kernel if self.kernel != "auto" else self._auto_path(x)
        if path != "dequant" and not self._pack_safe(x, path):
            return "dequant"
        return path

    def _auto_path(self, x: torch.Tensor) -> str:
        if x.device.type != "cpu":
            return "dequant"
        if x.dtype == torch.float32:
            return "pack_bf16"
        rows = x.numel() // max(1, x.shape[-1])
        limit = PACK_MAX_ROWS_LARGE if self.weight_int8.numel() >= LARGE_WEIGHT else PACK_MAX_ROWS
        if x.dtype == torch.bfloat16 and rows <= limit:
            return "pack"
        return "dequant"

    def _pack_safe(self, x: torch.Tensor, path: str) -> bool:
        """Whether `aten._weight_int8pack_mm` can take this call without crashing or miscomputing.

        Its AVX-512 bfloat16 kernel (torch 2.13) uses aligned vector loads without checking: with
        `in_features % 16 != 0` it returns wrong values or segfaults, and so does an input or weight
        pointer that is not 32-/16-byte aligned (inputs are re-allocated when unaligned; the weight
        is ours and allocated aligned, but it is checked all the same).
        """
        w = self.weight_int8
        if _PACK_MM is None or x.device.type != "cpu" or w.device.type != "cpu":
            return False
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        uses_bf16_kernel = path == "pack_bf16" or x.dtype == torch.bfloat16
        if uses_bf16_kernel and self.in_features % 16 != 0:
            return False
        return w.is_contiguous() and w.data_ptr() % _ALIGN == 0

    def _scale_in(self, dtype: torch.dtype) -> torch.Tensor:
        if self.scale.dtype == dtype:
            return self.scale
        if dtype == torch.bfloat16 and self.scale_bf16 is not None:
            return self.scale_bf16
        return self.scale.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self.path_for(x)
        if path == "dequant":
            return self._dequant(x)
        if _PACK_MM is None:
            raise RuntimeError("this torch has no aten._weight_int8pack_mm; use kernel='dequant'")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        compute = torch.bfloat16 if path == "pack_bf16" else x.dtype
        x2 = x2.to(compute).contiguous()
        if x2.data_ptr() % _ALIGN:
            x2 = x2.clone()  # a fresh allocation is 64-byte aligned
        y = _PACK_MM(x2, self.weight_int8, self._scale_in(compute)).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def _dequant(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        scale = self._scale_in(x.dtype)
        if x.dtype == torch.float16:
            # Scale the weight first: x @ q^T in float16 with |q| up to 127 may overflow 65504.
            w = self.weight_int8.to(x.dtype).mul_(scale.unsqueeze(1))
            return F.linear(x, w, bias)
        y = F.linear(x, self.weight_int8.to(x.dtype)) * scale
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scale_dtype={self.scale.dtype}, kernel={self.kernel!r}"
        )


def quantize_linears(
    model: nn.Module, *, skip: Collection[str] = frozenset({"lm_head"}), kernel: Kernel = "auto"
) -> int:
    """Replace every `nn.Linear` of `model` by an `Int8Linear` in place; returns how many.

    A linear is left alone when any component of its qualified name is in `skip`. By default that
    is the LM head, kept in the compute dtype because (1) the logits feed sampling directly: int8
    error there shifts every token's logit and flips near-ties of greedy decoding, where the
    decoder's errors are damped by RMSNorm and residual adds; and (2) with tied embeddings
    (Qwen2, Llama 3.2) `lm_head.weight` *is* the embedding table, so quantizing the head would add
    an int8 copy next to the float table the embedding lookup still needs: more memory, not less.

    Call it before LoRA layers wrap the projections: it replaces plain `nn.Linear` modules only
    (exact type), so a LoRA wrapper's own matrices are never touched. On CUDA the freed float
    weights are returned to the driver, so a KV pool sized afterwards from free memory can use them.
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {KERNELS}")
    names = [
        name
        for name, module in model.named_modules()
        if name and type(module) is nn.Linear and not any(part in skip for part in name.split("."))
    ]
    on_cuda = False
    # One layer at a time, holding no reference to the replaced ones, so the float weights are
    # freed as we go and the peak stays at the float model plus one layer.
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        linear = getattr(parent, child)
        on_cuda = on_cuda or linear.weight.device.type == "cuda"
        setattr(parent, child, Int8Linear.from_linear(linear, kernel=kernel))
        del linear
    if on_cuda:
        torch.cuda.empty_cache()
    return len(names)


def set_kernel(model: nn.Module, kernel: Kernel) -> int:
    """Force the forward path of every `Int8Linear` in `model` (benchmarks, tests); returns how many."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {KERNELS}")
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    for layer in layers:
        layer.kernel = kernel
    return len(layers)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer `model` holds, each storage counted once.

    Tied weights count once. Includes small non-weight buffers (the rotary `inv_freq`, a few KB);
    the KV cache is not part of the model and is not counted.
    """
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.is_mkldnn:  # a oneDNN-packed weight (packed_linear) has no storage to share
            total += t.numel() * t.element_size()
            continue
        key = (str(t.device), t.untyped_storage().data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total
