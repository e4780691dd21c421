"""The fused CPU kernels of a decoder layer (`fused_cpu`): each equal to the torch ops it replaces
(bit-identical where the arithmetic is, float32 and bfloat16, decode and prefill row counts), used
by `auto` on CPU with the engine token-identical to the torch ops, shape errors refused, and a
kernel that cannot build or disagrees falls back to the torch ops with one warning."""

from __future__ import annotations

import pathlib

import pytest
import structlog

torch = pytest.importorskip("torch")

from backends.base import SamplingParams  # noqa: E402
from backends.torch_llm.kernels import fused_cpu  # noqa: E402
from backends.torch_llm.model.llama import RMSNorm, apply_rotary  # noqa: E402
from tests.backends.torch_llm.conftest import engine_for, make_prompts, run_engine, serve_without_compiler  # noqa: E402

F = torch.nn.functional


@pytest.fixture
def kernels():  # noqa: ANN201
    """Skip where the kernels cannot be built (no C++ compiler): engines fall back, tested below."""
    try:
        return fused_cpu.load_kernels()
    except Exception as exc:  # noqa: BLE001 - any build failure
        pytest.skip(f"the fused CPU kernels do not build here: {exc}")


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# 1 and 16 rows: decode steps (one thread); 300 rows: a prefill chunk, split over the threads
ROWS = [1, 16, 300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_norms_equal_the_reference(kernels, rows: int, dtype: torch.dtype) -> None:
    hidden = 512
    norm = RMSNorm(hidden, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(hidden, dtype=dtype, seed=1))
    x, residual = _randn(rows, hidden, dtype=dtype, seed=2), _randn(rows, hidden, dtype=dtype, seed=3) * 4
    tol = 2e-6 if dtype == torch.float32 else 2e-2  # the mean of squares sums in another order
    assert torch.allclose(
        kernels.rms_norm(x, norm.weight, norm.eps).float(), norm(x).float(), atol=tol, rtol=tol
    )
    fused_x, fused_residual = x.clone(), residual.clone()
    kernels.add_rms_norm_(fused_x, fused_residual, norm.weight, norm.eps)
    assert torch.equal(fused_residual, residual + x)  # the residual add: the same single rounding
    assert torch.allclose(fused_x.float(), norm(residual + x).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_rotary_is_the_reference_bit_for_bit(kernels, rows: int, dtype: torch.dtype) -> None:
    heads, kv_heads, dim = 8, 2, 64
    qkv = _randn(rows, (heads + 2 * kv_heads) * dim, dtype=dtype, seed=4)
    positions = torch.arange(rows, dtype=torch.float32) * 37.0  # large angles too
    freqs = positions[:, None] * (1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [T, 1, D], as the model
    rotated = heads + kv_heads
    expected = apply_rotary(qkv[:, : rotated * dim].view(rows, rotated, dim), cos, sin).reshape(rows, -1)
    fused = qkv.clone()
    kernels.rotary_(fused, cos, sin, rotated, dim)
    assert torch.equal(fused[:, : rotated * dim], expected)
    assert torch.equal(fused[:, rotated * dim :], qkv[:, rotated * dim :])  # v is not rotated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_equals_the_reference(kernels, rows: int, dtype: torch.dtype) -> None:
    gate_up = _randn(rows, 2 * 1408, dtype=dtype, seed=5) * 6
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # beyond exp's range, and zeros
    gate, up = gate_up.chunk(2, dim=-1)
    got, want = kernels.silu_mul(gate_up), F.silu(gate) * up
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.isfinite(got).all()


def test_the_kernels_refuse_bad_shapes(kernels) -> None:
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="weight vs input"):
        kernels.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.rms_norm(x.t(), torch.ones(4), 1e-6)
    with pytest.raises(RuntimeError, match="input vs residual"):
        kernels.add_rms_norm_(x, torch.randn(3, 64), torch.ones(64), 1e-6)
    with pytest.raises(RuntimeError, match="heads x head_dim"):
        kernels.rotary_(x, torch.ones(4, 16), torch.ones(4, 16), 5, 16)
    with pytest.raises(RuntimeError, match="cos/sin"):
        kernels.rotary_(x, torch.ones(3, 16), torch.ones(3, 16), 2, 16)
    with pytest.raises(RuntimeError, match="equal size"):
        kernels.silu_mul(torch.randn(2, 7))


def test_auto_on_cpu_uses_them_and_is_token_identical(llama_dir: pathlib.Path, kernels) -> None:
    prompts = make_prompts(10, seed=7)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # a small token budget: prompts arrive in chunks beside decodes (prefill and decode rows mixed)
    fused = engine_for(llama_dir, max_num_batched_tokens=40)
    assert fused.runner.model.fused_ops is not None
    reference = engine_for(llama_dir, max_num_batched_tokens=40, fused_ops="torch")
    assert reference.runner.model.fused_ops is None
    assert run_engine(fused, prompts, params) == run_engine(reference, prompts, params)


def test_kernels_that_cannot_build_fall_back_with_one_warning(llama_dir, monkeypatch) -> None:
    engine, warnings = serve_without_compiler(
        llama_dir, monkeypatch, fused_cpu, "load_kernels", "llm_fused_ops_fallback"
    )
    assert engine.runner.model.fused_ops is None
    assert len(warnings) == 1 and "c++ not found" in warnings[0]["reason"]


def test_a_kernel_that_disagrees_is_not_used(kernels, monkeypatch) -> None:
    class OffByOne:  # failure injection: a miscompiled silu_mul
        def __getattr__(self, name: str):  # noqa: ANN204
            return getattr(kernels, name)

        def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
            return kernels.silu_mul(gate_up) + 1.0

    monkeypatch.setattr(fused_cpu, "load_kernels", OffByOne)
    with structlog.testing.capture_logs() as logs:
        assert fused_cpu.cpu_kernels_or_none(torch.float32) is None
    assert "silu_mul disagrees" in logs[0]["reason"]


def test_silu_at_the_ends_of_the_float_range_is_torchs(kernels) -> None:
    x = torch.tensor(
        [[-3e38, -1e37, -100.0, -88.8, -88.0, -float("inf"), float("inf"), float("nan"), 0.0, 5.0]]
    )
    got = kernels.silu_mul(torch.cat([x, torch.ones_like(x)], dim=-1))
    want = F.silu(x)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-6, atol=0.0)
    assert torch.equal(torch.signbit(got[~want.isnan()]), torch.signbit(want[~want.isnan()]))  # -0 stays -0


def test_the_prefill_rows_split_over_threads_equal_one_thread(kernels) -> None:
    # the test session runs torch on one thread: here two, so the parallel split runs too
    x, residual = _randn(300, 512, dtype=torch.float32, seed=8), _randn(300, 512, dtype=torch.float32, seed=9)
    weight = _randn(512, dtype=torch.float32, seed=10)
    gate_up = _randn(300, 2816, dtype=torch.float32, seed=11)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            fx, fr = x.clone(), residual.clone()
            kernels.add_rms_norm_(fx, fr, weight, 1e-6)
            outs.append((fx, fr, kernels.silu_mul(gate_up)))
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*outs, strict=True):
        assert torch.equal(one, two)


def test_the_kernels_refuse_overlapping_or_empty_rows(kernels) -> None:
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="single memory location"):
        kernels.add_rms_norm_(x, x, torch.ones(64), 1e-6)  # residual and input the same memory
    with pytest.raises(RuntimeError, match="non-empty rows"):
        kernels.rms_norm(torch.empty(3, 0), torch.empty(0), 1e-6)
    with pytest.raises(RuntimeError, match="non-empty rows"):
        kernels.silu_mul(torch.empty(3, 0))
    with pytest.raises(RuntimeError, match="not overlapping"):
        kernels.rotary_(torch.randn(1, 64).expand(4, 64), torch.ones(4, 16), torch.ones(4, 16), 2, 16)


def test_the_kernels_let_other_threads_run(kernels) -> None:
    """The engine steps on a thread beside the event loop: a kernel must release the GIL while it
    computes. A counting thread keeps its pace through long kernel calls when it does (measured:
    1.35x its pace beside a sleeping thread); were the GIL held, it could count only in the 5 ms
    switch intervals between calls (measured: 0.11x, with calls of ~80 ms)."""
    import threading
    import time

    count, stop = [0], threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1

    gate_up = torch.randn(1024, 2 * 16384)  # tens of ms a call on one thread
    thread = threading.Thread(target=counter)
    thread.start()
    try:
        start, began = count[0], time.perf_counter()
        time.sleep(0.2)
        beside_sleep = (count[0] - start) / (time.perf_counter() - began)
        start, began = count[0], time.perf_counter()
        for _ in range(4):
            kernels.silu_mul(gate_up)
        beside_kernel = (count[0] - start) / (time.perf_counter() - began)
    finally:
        stop.set()
        thread.join()
    assert beside_kernel > 0.5 * beside_sleep
