"""Weight-only int8 (`backends.torch_llm.model.quantization`): error bounds, model outputs, memory, refusal.

Bounds used below, with `s_n` the scale of output channel n and `Wq = q * s` the dequantised weight:

- quantization: `|w - wq| <= s_n / 2` per weight (round to nearest; the scale is rounded to bfloat16,
  so |w| / s_n <= 127.25 and the clamp to 127 costs at most a quarter step), hence per output
  `|x W^T - x Wq^T|_mn <= s_n / 2 * sum_k |x_mk|`;
- arithmetic of a path against `x Wq^T` computed exactly: float32 accumulation `K * 2^-23`, and for
  bfloat16 inputs or outputs `2^-9` per rounding (two at most), each times `(|x| |Wq|^T)_mn`.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from backends.torch_llm.model import quantization  # noqa: E402
from backends.torch_llm.model.loader import load_model  # noqa: E402
from backends.torch_llm.model.quantization import (  # noqa: E402
    Int8Linear,
    check_quantization,
    quantize_linears,
    set_kernel,
    weight_bytes,
)
from backends.torch_llm.runner import ModelRunner  # noqa: E402
from backends.torch_llm.sequence import Sequence  # noqa: E402

CPU = torch.device("cpu")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linear(n: int, k: int, *, bias: bool, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=gen) * 0.05)
        lin.weight[3].zero_()  # an all-zero output channel
        lin.weight[5, 7] = 0.9  # an outlier: row 5 gets a coarse scale
        if bias:
            lin.bias.copy_(torch.randn(n, generator=gen))
    return lin.to(dtype).requires_grad_(False)


def _bounds(layer: Int8Linear, lin: nn.Linear, x: torch.Tensor, rounding: float) -> tuple[torch.Tensor, ...]:
    """(float output, exact dequantised output, quantization bound, arithmetic bound), all float64."""
    x64 = x.double().reshape(-1, x.shape[-1])
    w64 = lin.weight.double()
    wq = layer.weight_int8.double() * layer.scale.double().unsqueeze(1)
    b64 = 0.0 if lin.bias is None else lin.bias.double()
    y_float = x64 @ w64.t() + b64
    y_exact = x64 @ wq.t() + b64
    quant = layer.scale.double() / 2 * x64.abs().sum(1, keepdim=True)
    k = x.shape[-1]
    mag = x64.abs() @ wq.abs().t() + (0.0 if lin.bias is None else b64.abs())
    arith = (rounding + k * 2.0**-23) * mag + 1e-12
    return y_float, y_exact, quant, arith


def test_codes_and_scales_are_per_channel_symmetric() -> None:
    lin = _linear(48, 64, bias=False)
    layer = Int8Linear.from_linear(lin)
    q, s = layer.weight_int8, layer.scale
    assert q.dtype == torch.int8 and q.shape == (48, 64) and s.shape == (48,) and s.dtype == torch.float32
    assert (layer.in_features, layer.out_features) == (64, 48)
    assert int(q.abs().max()) <= 127 and int(q.min()) >= -127
    nonzero = [n for n in range(48) if n != 3]
    assert (q[nonzero].abs().amax(1) == 127).all(), "every non-zero row uses the full code range"
    assert (q[3] == 0).all() and s[3] == 1.0, "an all-zero row: zero codes, scale 1"
    # Scales are bfloat16-representable (the bfloat16 kernel sees the same scale) and within one
    # bfloat16 rounding of max|w| / 127.
    assert torch.equal(s, s.bfloat16().float())
    raw = lin.weight.abs().amax(1) / 127
    assert torch.allclose(s[nonzero], raw[nonzero], rtol=2**-8, atol=0)
    # Round to nearest: every weight within half a step of its dequantised value.
    err = (lin.weight.double() - q.double() * s.double().unsqueeze(1)).abs()
    assert (err <= s.double().unsqueeze(1) / 2 + 1e-12).all()
    assert layer.weight_bytes() == 48 * 64 + 48 * 4 + 48 * 2  # codes, float32 scale, bfloat16 copy


@pytest.mark.parametrize(
    ("dtype", "kernel", "path", "rounding"),
    [
        (torch.float32, "auto", "pack_bf16", 2.0**-8),  # float32 through the bfloat16 int8 kernel
        (torch.float32, "pack", "pack", 0.0),  # the float32 kernel (scalar in torch 2.13)
        (torch.float32, "dequant", "dequant", 0.0),
        (torch.bfloat16, "auto", "pack", 2.0**-8),
        (torch.bfloat16, "dequant", "dequant", 2.0**-8),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_within_quantization_bound(monkeypatch, dtype, kernel, path, rounding, bias) -> None:
    calls = []
    real = quantization._PACK_MM
    monkeypatch.setattr(quantization, "_PACK_MM", lambda *a: calls.append(a[0].dtype) or real(*a))
    lin = _linear(96, 128, bias=bias, dtype=dtype, seed=1)
    layer = Int8Linear.from_linear(lin, kernel=kernel)
    assert layer.scale.dtype == dtype
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 128, generator=gen).to(dtype)  # 3-D: reshaped to 2-D and back
    assert layer.path_for(x) == path
    y = layer(x)
    assert y.shape == (2, 4, 96) and y.dtype == dtype
    assert bool(calls) == (path != "dequant")
    if path == "pack_bf16":
        assert calls == [torch.bfloat16]
    y_float, y_exact, quant, arith = _bounds(layer, lin, x, rounding)
    y = y.double().reshape(8, 96)
    assert ((y - y_exact).abs() <= arith).all(), "arithmetic error of the path beyond its bound"
    assert ((y - y_float).abs() <= quant + arith).all(), "beyond the int8 quantization bound"
    # Typical error is far inside the worst-case bound: ~1% of the output's size here.
    rel = (y - y_float).norm() / y_float.norm()
    assert rel < 0.02, rel


def test_zero_row_outputs_exactly_the_bias() -> None:
    lin = _linear(32, 64, bias=True)
    layer = Int8Linear.from_linear(lin)
    x = torch.randn(4, 64)
    for kernel in ("auto", "pack", "dequant"):
        set_kernel(layer, kernel)
        assert torch.equal(layer(x)[:, 3], lin.bias[3].expand(4)), kernel


def test_kernel_never_gets_shapes_or_pointers_it_mishandles() -> None:
    # torch 2.13's AVX-512 bfloat16 int8 kernel miscomputes or segfaults with in_features % 16 != 0
    # or an input pointer not 32-byte aligned; those calls must not reach it.
    odd = Int8Linear.from_linear(_linear(40, 170, bias=False, dtype=torch.bfloat16))
    x = torch.randn(3, 170)
    for kernel in ("auto", "pack", "pack_bf16"):
        set_kernel(odd, kernel)
        assert odd.path_for(x.bfloat16()) == "dequant", kernel
        assert odd.path_for(x) == ("pack" if kernel == "pack" else "dequant"), kernel  # float32 kernel: fine
        assert odd(x.bfloat16()).shape == (3, 40)
    lin = _linear(40, 64, bias=False, dtype=torch.bfloat16)
    layer = Int8Linear.from_linear(lin)
    flat = torch.randn(3 * 64 + 8).bfloat16()
    for offset in (1, 8):  # 2 and 16 bytes past an aligned start
        x = flat[offset : offset + 3 * 64].view(3, 64)
        assert layer.path_for(x) == "pack"
        y = layer(x).double()
        _, y_exact, _, arith = _bounds(layer, lin, x, 2.0**-8)
        assert ((y - y_exact).abs() <= arith).all(), offset


def test_bfloat16_switches_to_dequant_for_many_rows() -> None:
    layer = Int8Linear.from_linear(_linear(32, 64, bias=False, dtype=torch.bfloat16))
    limit = quantization.PACK_MAX_ROWS
    assert layer.path_for(torch.randn(limit, 64).bfloat16()) == "pack"
    assert layer.path_for(torch.randn(limit + 1, 64).bfloat16()) == "dequant"
    assert layer.path_for(torch.randn(500, 64)) == "pack_bf16"  # float32: one path whatever the rows
    # Large weights keep the kernel longer (a path choice only: no need to compute with it).
    big = Int8Linear(torch.zeros(4096, 4096, dtype=torch.int8), torch.ones(4096, dtype=torch.bfloat16))
    assert big.path_for(torch.zeros(quantization.PACK_MAX_ROWS_LARGE, 4096).bfloat16()) == "pack"
    assert big.path_for(torch.zeros(quantization.PACK_MAX_ROWS_LARGE + 1, 4096).bfloat16()) == "dequant"


def test_works_as_a_lora_base() -> None:
    lora_layers = pytest.importorskip("backends.torch_llm.lora.layers")
    base = Int8Linear.from_linear(_linear(32, 64, bias=True, dtype=torch.bfloat16))
    wrapped = lora_layers.LoRALinear(base, 64, 32, num_slots=2, max_rank=4, batch=lora_layers.LoRABatch())
    assert wrapped.a_slots.dtype == torch.bfloat16, "the wrapper must see the compute dtype"
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(wrapped(x), base(x))


def _greedy(runner: ModelRunner, prompt: list[int], n: int, forced: list[int] | None = None):
    """Greedy tokens and per-step logits; with `forced`, those tokens are fed instead (same contexts)."""
    seq = Sequence(0, "r", prompt, max_tokens=n)
    seq.block_table = list(range(-(-(len(prompt) + n) // runner.block_size)))
    tokens, logits = [], []
    for i in range(n):
        out, _ = runner.execute([(seq, seq.num_uncomputed_tokens)])
        seq.num_computed_tokens = seq.num_tokens
        tokens.append(int(out[0].argmax()))
        logits.append(out[0])
        seq.append_token(forced[i] if forced is not None else tokens[-1])
    return tokens, torch.stack(logits)


def _runner(folder, dtype: torch.dtype, quantize: bool) -> ModelRunner:
    model = load_model(folder, CPU, dtype)
    if quantize:
        assert quantize_linears(model) == 7 * model.config.num_hidden_layers
    return ModelRunner(model, num_blocks=64, block_size=8)


# Measured on `llama_dir` (seed 1, 2 layers, hidden 64) with the prompts below: max |logit error|
# 0.027 on the float32 auto path (the same when dequantising to float32), against max |logit| 1.69;
# greedy tokens 87% identical free-running, 97% teacher-forced. Estimate: a Gaussian row's int8 error
# is max|w| / (127 sqrt(12)) ~ 0.7% of its output per linear; with four linears in series per layer
# and two layers that is ~1-2% of the logits' size (1.69 -> 0.02-0.03). The bound is about twice the
# measurement.
MAX_LOGIT_ERROR = 0.06


def test_quantized_llama_follows_the_float_model(llama_dir) -> None:
    rng = random.Random(7)
    prompts = [[0] + [rng.randrange(6, 500) for _ in range(rng.randint(0, 40))] for _ in range(6)]
    n = 24
    ref, q8 = _runner(llama_dir, torch.float32, False), _runner(llama_dir, torch.float32, True)
    paths = {
        m.path_for(torch.zeros(1, m.in_features)) for m in q8.model.modules() if isinstance(m, Int8Linear)
    }
    assert paths == {"pack_bf16", "dequant"}, paths  # down_proj (in 170) cannot take the kernel
    agree = total = teacher_agree = 0
    for p in prompts:
        f_tokens, f_logits = _greedy(ref, p, n)
        q_tokens, _ = _greedy(q8, p, n)
        forced_tokens, q_logits = _greedy(q8, p, n, forced=f_tokens)  # same contexts as the float run
        agree += sum(a == b for a, b in zip(f_tokens, q_tokens, strict=True))
        teacher_agree += sum(a == b for a, b in zip(f_tokens, forced_tokens, strict=True))
        total += n
        err = (f_logits - q_logits).abs()
        assert float(err.max()) <= MAX_LOGIT_ERROR, float(err.max())
        # A teacher-forced flip needs a float top-2 gap within twice that step's logit error.
        for i, (a, b) in enumerate(zip(f_tokens, forced_tokens, strict=True)):
            if a != b:
                assert float(f_logits[i, a] - f_logits[i, b]) <= 2 * float(err[i].max())
    assert teacher_agree / total >= 0.9, teacher_agree / total
    assert agree / total >= 0.75, agree / total  # free-running: a flip changes the rest of the prompt


def test_qwen2_bfloat16_keeps_tied_head_and_biases(qwen2_dir) -> None:
    ref, q8 = _runner(qwen2_dir, torch.bfloat16, False), _runner(qwen2_dir, torch.bfloat16, True)
    model = q8.model
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, Int8Linear) and attn.q_proj.bias is not None
    assert attn.q_proj.scale.dtype == torch.bfloat16 and attn.q_proj.scale_bf16 is None
    same = 0
    # 41 prompt tokens: the prefill takes the "dequant" path, the decodes the int8 kernel ("pack").
    for prompt in ([0, *range(20, 60)], [0, 7, 8, 9]):
        f_tokens, f_logits = _greedy(ref, prompt, 16)
        forced_tokens, q_logits = _greedy(q8, prompt, 16, forced=f_tokens)
        # Both runs carry bfloat16 rounding besides the int8 error; measured max 0.029 and 0.020.
        err = (f_logits - q_logits).abs()
        assert float(err.max()) <= MAX_LOGIT_ERROR
        for i, (a, b) in enumerate(zip(f_tokens, forced_tokens, strict=True)):
            same += a == b
            if a != b:
                assert float(f_logits[i, a] - f_logits[i, b]) <= 2 * float(err[i].max())
    assert same >= 26, same  # measured 30 of 32 teacher-forced


def test_decoder_weights_shrink_to_a_quarter(llama_dir) -> None:
    model = load_model(llama_dir, CPU, torch.float32)
    before = weight_bytes(model)
    linears = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJECTIONS]
    float_bytes = sum(m.weight.numel() * 4 for m in linears)
    assert quantize_linears(model) == len(linears) == 14
    layers = [m for m in model.modules() if isinstance(m, Int8Linear)]
    int8_bytes = sum(m.weight_bytes() for m in layers)
    # codes (1 byte) + float32 scale and its bfloat16 copy per output channel (6 bytes)
    assert int8_bytes == sum(m.out_features * (m.in_features + 6) for m in layers)
    assert 0.25 < int8_bytes / float_bytes < 0.28  # in_features 64..170: 6 / (4 * in) overhead
    assert before - weight_bytes(model) == float_bytes - int8_bytes
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    assert quantize_linears(model) == 0, "already quantized: nothing left to replace"


def test_skip_and_lm_head() -> None:
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(16, 16))
    model.add_module("lm_head", nn.Linear(16, 32))
    assert quantize_linears(model, skip=set()) == 2
    assert isinstance(model.lm_head, Int8Linear)


def test_unknown_method_is_refused() -> None:
    check_quantization(None, "cpu")
    check_quantization("int8", "cpu")
    check_quantization("int8", "cuda")
    with pytest.raises(ValueError, match=r"quantization 'int4' is not supported.*supported: 'int8'"):
        check_quantization("int4", "cpu")
    with pytest.raises(ValueError, match="not supported"):
        check_quantization("fp8", "cuda")
    with pytest.raises(ValueError, match="runs on cpu and cuda"):
        check_quantization("int8", "mps")
    with pytest.raises(ValueError, match="kernel"):
        quantize_linears(nn.Linear(4, 4), kernel="fast")  # type: ignore[arg-type]
