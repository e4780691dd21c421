"""The C++ paged-decode kernel on CPU: chosen by `auto`, equal to gather + SDPA on paged data (GQA,
partial blocks, a single key, float32 and bfloat16), token-identical in the engine, and a kernel that
cannot be built falls back to gather + SDPA with one warning."""

from __future__ import annotations

import pathlib
import random

import pytest

torch = pytest.importorskip("torch")

from backends.base import SamplingParams  # noqa: E402
from backends.torch_llm.kernels import attention_cpu  # noqa: E402
from backends.torch_llm.model.attention import AttentionMetadata, TorchPagedAttention  # noqa: E402
from tests.backends.torch_llm.conftest import engine_for, make_prompts, run_engine, serve_without_compiler  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture
def kernel() -> None:
    """Skip where the kernel cannot be built (no C++ compiler): engines fall back, tested below."""
    try:
        attention_cpu.load_kernel()
    except Exception as exc:  # noqa: BLE001 - any build failure
        pytest.skip(f"the CPU paged-decode kernel does not build here: {exc}")


def _paged_case(
    heads: int, kv_heads: int, dim: int, bs: int, lengths: list[int], dtype: torch.dtype, seed: int
):  # noqa: ANN202
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // bs) for n in lengths) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lengths:
        tables.append(order[used : used + -(-n // bs)])
        used += len(tables[-1])
    k = torch.randn(num_blocks * bs, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks * bs, kv_heads, dim, generator=gen).to(dtype)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(dtype)
    new = torch.randn(len(lengths), kv_heads, dim, generator=gen).to(dtype)
    slots = torch.tensor([t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lengths, strict=True)])
    return tables, k, v, q, new, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs"), [(4, 2, 16, 8), (8, 8, 64, 16), (6, 1, 32, 4)])
def test_kernel_equals_gather_sdpa(heads, kv_heads, dim, bs, dtype, kernel) -> None:
    lengths = [1, bs, bs + 1, 3 * bs - 1, 97, 5 * bs]
    tables, k, v, q, new, slots = _paged_case(heads, kv_heads, dim, bs, lengths, dtype, seed=heads + dim)
    outs = []
    for impl in (
        attention_cpu.CpuPagedAttention(heads, kv_heads, dim, block_size=bs, device=CPU),
        TorchPagedAttention(heads, kv_heads, dim, block_size=bs, device=CPU),
    ):
        meta = AttentionMetadata(
            slot_mapping=slots, num_decodes=len(lengths), decodes=impl.prepare_decodes(tables, lengths)
        )
        outs.append(impl(q, new, new, k.clone(), v.clone(), meta).float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (outs[0] - outs[1]).abs().max().item() < tol


def test_auto_on_cpu_uses_the_kernel_and_is_token_identical(llama_dir: pathlib.Path, kernel) -> None:
    prompts = make_prompts(12, seed=4)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    # a small pool: sequences are preempted and recomputed, prefix blocks are shared
    fast = engine_for(llama_dir, num_kv_blocks=24, max_num_batched_tokens=32)
    assert fast.runner.attention.name == "cpu_kernel"
    reference = engine_for(llama_dir, num_kv_blocks=24, max_num_batched_tokens=32, attention_backend="torch")
    assert run_engine(fast, prompts, params) == run_engine(reference, prompts, params)
    assert fast.scheduler.num_preemptions > 0


def test_a_kernel_that_cannot_build_falls_back_with_one_warning(llama_dir, monkeypatch) -> None:
    engine, warnings = serve_without_compiler(
        llama_dir, monkeypatch, attention_cpu, "load_kernel", "llm_attention_fallback"
    )
    assert engine.runner.attention.name == "torch"
    assert len(warnings) == 1 and "c++ not found" in warnings[0]["reason"]


def test_long_contexts_many_rows(llama_dir: pathlib.Path, kernel) -> None:
    # more rows than threads' work items, contexts across many blocks
    rng = random.Random(0)
    lengths = [rng.randint(1, 700) for _ in range(40)]
    tables, k, v, q, new, slots = _paged_case(8, 2, 64, 16, lengths, torch.float32, seed=9)
    outs = []
    for impl in (
        attention_cpu.CpuPagedAttention(8, 2, 64, block_size=16, device=CPU),
        TorchPagedAttention(8, 2, 64, block_size=16, device=CPU),
    ):
        meta = AttentionMetadata(
            slot_mapping=slots, num_decodes=len(lengths), decodes=impl.prepare_decodes(tables, lengths)
        )
        outs.append(impl(q, new, new, k.clone(), v.clone(), meta))
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5


def test_the_kernel_refuses_what_would_read_out_of_bounds(kernel) -> None:
    tables, k, v, q, new, slots = _paged_case(4, 2, 16, 8, [9, 20], torch.float32, seed=1)
    impl = attention_cpu.CpuPagedAttention(4, 2, 16, block_size=8, device=CPU)
    short, lens = impl.prepare_decodes([tables[0], tables[1][:1]], [9, 20])  # 20 keys need 3 blocks
    with pytest.raises(RuntimeError, match="block table"):
        impl._kernel.paged_decode(q, k, v, short, lens, 0.25, 8, torch.empty_like(q))
    bad, lens = impl.prepare_decodes([[10_000, 0], tables[1]], [9, 20])
    with pytest.raises(RuntimeError, match="out of range"):
        impl._kernel.paged_decode(q, k, v, bad, lens, 0.25, 8, torch.empty_like(q))
