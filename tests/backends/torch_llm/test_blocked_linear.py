"""fleetgate's blocked float32 linear kernel on CPU: equal to F.linear for every tile height, a
partial last block, a bias and leading dimensions; the engine's default on CPU for float32; oneDNN
where it does not build (failure injection) and a clear error where it is asked for and cannot serve."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from backends.torch_llm.kernels import blocked_linear  # noqa: E402
from backends.torch_llm.kernels.blocked_linear import BlockedLinear, block_weight  # noqa: E402
from backends.torch_llm.kernels.packed_linear import PackedLinear, onednn_available  # noqa: E402
from tests.backends.torch_llm.conftest import engine_for, serve_without_compiler  # noqa: E402


@pytest.fixture(scope="module")
def kernel():
    built = blocked_linear.kernel_or_none()
    if built is None:
        pytest.skip("the blocked linear kernel does not build here (no C++ toolchain)")
    return built


def test_block_weight_layout() -> None:
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    blocked = block_weight(weight)
    assert blocked.shape == (2, 3, 16)
    for n in range(20):
        assert torch.equal(blocked[n // 16, :, n % 16], weight[n])
    assert not blocked[1, :, 4:].any(), "columns past N are zero padding"


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 16, 70])
@pytest.mark.parametrize(("out_features", "bias"), [(16, False), (37, True), (200, False), (200, True)])
def test_blocked_equals_f_linear(kernel, rows: int, out_features: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    linear = nn.Linear(96, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, 96, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=gen))
    x = torch.randn(rows, 96, generator=gen)
    expected = F.linear(x, linear.weight, linear.bias)
    got = BlockedLinear(linear, kernel)(x)
    assert got.shape == expected.shape and got.is_contiguous()
    assert (got - expected).abs().max().item() <= 1e-5 * expected.abs().max().item() + 1e-6


def test_leading_dimensions_and_strided_input(kernel) -> None:
    linear = nn.Linear(32, 24)
    x = torch.randn(2, 3, 64)[..., ::2]  # [2, 3, 32], not contiguous
    got = BlockedLinear(linear, kernel)(x)
    assert got.shape == (2, 3, 24)
    assert torch.allclose(got, F.linear(x, linear.weight, linear.bias), atol=1e-5)


def test_kernel_refuses_wrong_inputs(kernel) -> None:
    layer = BlockedLinear(nn.Linear(32, 24), kernel)
    with pytest.raises(RuntimeError, match="K = x's columns"):
        kernel.blocked_linear(torch.randn(2, 31), layer.blocked_weight, layer.padded_bias, 24)
    with pytest.raises(RuntimeError, match="float32"):
        kernel.blocked_linear(torch.randn(2, 32, dtype=torch.float64), layer.blocked_weight, layer.padded_bias, 24)
    with pytest.raises(RuntimeError, match="N vs weight blocks"):
        kernel.blocked_linear(torch.randn(2, 32), layer.blocked_weight, layer.padded_bias, 40)


def test_engine_uses_blocked_linears_on_cpu_float32(kernel, llama_dir) -> None:
    layer = engine_for(llama_dir).runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, BlockedLinear) and layer.self_attn.q_proj is None
    assert isinstance(layer.mlp.gate_up_proj, BlockedLinear) and isinstance(layer.mlp.down_proj, BlockedLinear)
    if onednn_available(torch.float32):
        chosen = engine_for(llama_dir, linear_backend="onednn").runner.model.model.layers[0]
        assert isinstance(chosen.mlp.down_proj, PackedLinear)


def test_blocked_is_float32_only(kernel, llama_dir) -> None:
    with pytest.raises(ValueError, match="float32, not torch.bfloat16"):
        engine_for(llama_dir, linear_backend="blocked", dtype="bfloat16")


def test_without_a_compiler_auto_falls_back_and_blocked_refuses(llama_dir, monkeypatch) -> None:
    engine, warnings = serve_without_compiler(
        llama_dir, monkeypatch, blocked_linear, "load_kernel", "llm_blocked_linear_fallback"
    )
    assert len(warnings) == 1 and "c++ not found" in warnings[0]["reason"]
    down = engine.runner.model.model.layers[0].mlp.down_proj
    assert not isinstance(down, BlockedLinear)
    with pytest.raises(ValueError, match="blocked kernel does not build"):
        engine_for(llama_dir, linear_backend="blocked")
