"""Linear layers on CPU through oneDNN with weights packed once at load (`linear_backend`).

`F.linear` on CPU multiplies against the weight as stored ([out, in], row-major). oneDNN's linear
with a weight reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`)
reads it in the order its kernels want and uses every intra-op thread on small row counts: measured
on this project's 2-core CPU, a decoder's worth of [1408, 512] projections (173 MB) took 17.0 ms at
1 row and 22.9 ms at 16 rows with `F.linear`, 8.9 ms and 10.5 ms packed (2 threads). Decode steps are
exactly those row counts, so the engine packs every projection (and an untied LM head) on CPU.

The packed weight replaces the original (no second copy); results equal `F.linear`'s to float32
rounding (a different summation order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

#: the packing is tuned for this many rows (a decode step's); any row count works
ROWS_HINT = 16


def onednn_available(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    # bfloat16 only where the CPU has native bf16 instructions (oneDNN would emulate it slowly)
    return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """`y = x W^T + b` with W packed for oneDNN; `x` is [..., in] in the weight's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(
    model: nn.Module,
    *,
    skip: frozenset[str] = frozenset(),
    make: Callable[[nn.Linear], nn.Module] = PackedLinear,
) -> int:
    """Replace every plain `nn.Linear` of `model` (not named in `skip`) by `make(linear)`: a
    `PackedLinear` by default, or another layout's module (`blocked_linear.BlockedLinear`).

    A weight shared with another module (an LM head tied to the embeddings) is left alone: packing
    it would keep a second copy of the matrix. Returns how many layers were packed.
    """
    shared = _shared_weights(model)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and name.rsplit(".", 1)[-1] not in skip
        and id(module.weight) not in shared
    ]
    for name, module in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, make(module))
    return len(targets)


def fuse_projections(model: nn.Module) -> int:
    """Give every decoder layer one q|k|v and one gate|up projection (plain `nn.Linear`s, packed by
    `pack_linears` after this), dropping the separate ones: one weight read pass and one call
    instead of three and two. Each output is the same dot product as before. Not for models whose
    projections are wrapped (LoRA) or quantized: those keep the separate modules. Returns the
    number of layers fused."""
    fused = 0
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = [attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj]
        if not all(type(p) is nn.Linear for p in parts):
            continue
        attn.qkv_proj = _concat([attn.q_proj, attn.k_proj, attn.v_proj])
        mlp.gate_up_proj = _concat([mlp.gate_proj, mlp.up_proj])
        attn.q_proj = attn.k_proj = attn.v_proj = None
        mlp.gate_proj = mlp.up_proj = None
        fused += 1
    return fused


def _concat(linears: list[nn.Linear]) -> nn.Linear:
    first = linears[0]
    out = sum(lin.out_features for lin in linears)
    with torch.device("meta"):
        joined = nn.Linear(first.in_features, out, bias=first.bias is not None)
    weight = torch.cat([lin.weight.detach() for lin in linears])
    joined.weight = nn.Parameter(weight, requires_grad=False)
    if first.bias is not None:
        joined.bias = nn.Parameter(torch.cat([lin.bias.detach() for lin in linears]), requires_grad=False)
    return joined


def _shared_weights(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        seen[id(param)] = seen.get(id(param), 0) + 1
    return {pid for pid, count in seen.items() if count > 1}
