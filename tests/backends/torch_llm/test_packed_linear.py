"""oneDNN linears with weights packed at load: equal to F.linear, used on CPU when asked for (the
default for bfloat16), a tied LM head left unpacked (no second copy), and `linear_backend: torch`
keeping plain linears."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from backends.torch_llm.kernels.packed_linear import PackedLinear, onednn_available, pack_linears  # noqa: E402
from tests.backends.torch_llm.conftest import engine_for  # noqa: E402

pytestmark = pytest.mark.skipif(not onednn_available(torch.float32), reason="no oneDNN in this torch build")


@pytest.mark.parametrize("rows", [1, 3, 16, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(200, 96, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    expected = F.linear(x, linear.weight, linear.bias)
    got = PackedLinear(linear)(x)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item() + 1e-6


def test_engine_packs_projections_on_cpu_and_not_a_tied_head(llama_dir, qwen2_dir) -> None:
    layer = engine_for(llama_dir, linear_backend="onednn").runner.model.model.layers[0]
    # q|k|v and gate|up are fused into one packed projection each
    assert isinstance(layer.self_attn.qkv_proj, PackedLinear) and layer.self_attn.q_proj is None
    assert isinstance(layer.mlp.gate_up_proj, PackedLinear) and isinstance(layer.mlp.down_proj, PackedLinear)
    with_lora = engine_for(llama_dir, linear_backend="onednn", enable_lora=True).runner.model.model.layers[0]
    assert with_lora.self_attn.qkv_proj is None, "LoRA wraps q, k and v one by one"
    assert isinstance(with_lora.self_attn.q_proj.base, PackedLinear)
    tied = engine_for(qwen2_dir, linear_backend="onednn").runner.model  # qwen2 fixture ties the LM head to the embeddings
    assert type(tied.lm_head) is nn.Linear and tied.lm_head.weight is tied.model.embed_tokens.weight
    plain = engine_for(llama_dir, linear_backend="torch").runner.model.model.layers[0]
    assert type(plain.self_attn.q_proj) is nn.Linear


def test_fused_projections_equal_the_separate_ones(llama_dir) -> None:
    from backends.torch_llm.kernels.packed_linear import fuse_projections
    from backends.torch_llm.model.loader import load_model

    model = load_model(llama_dir, torch.device("cpu"), torch.float32)
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    x = torch.randn(5, attn.q_proj.in_features, generator=torch.Generator().manual_seed(0))
    separate = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), mlp(x)]
    assert fuse_projections(model) == len(model.model.layers)
    fused = [*attn.qkv_proj(x).split(attn.qkv_sizes, dim=-1), mlp(x)]
    for a, b in zip(separate, fused, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)


def test_pack_linears_counts_and_skips() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert pack_linears(model, skip=frozenset({"2"})) == 1
    assert isinstance(model[0], PackedLinear) and type(model[2]) is nn.Linear
