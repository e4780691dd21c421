"""The correctness suite on CUDA (skipped without a GPU; not run in CI, which has none)."""

from __future__ import annotations

import gc

import pytest

from backends.base import SamplingParams
from tests.backends.torch_llm.conftest import engine_for, hf_greedy, make_prompts, run_engine

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(autouse=True)
def _release_the_gpu():
    """Each engine sized by `gpu_memory_utilization` takes most of the card for its KV cache: the
    previous test's engine (kept alive by reference cycles until collected) must be gone first."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_greedy_matches_transformers_with_chunking_and_preemption(request, arch) -> None:
    folder = request.getfixturevalue(f"{arch}_dir")
    prompts = make_prompts(32, seed=7)
    reference = hf_greedy(folder, prompts, 64)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    engine = engine_for(folder, device="cuda", dtype="float32", num_kv_blocks=40, max_num_batched_tokens=16)
    outputs = run_engine(engine, prompts, params, arrival_steps=[2 * i for i in range(32)])
    assert engine.scheduler.num_preemptions > 0
    assert [outputs[i] for i in range(32)] == reference
    if _has_triton():  # the decodes above went through the Triton kernel, not the fallback
        assert engine.runner.attention.name == "triton"
        assert engine.runner.attention.disabled_reason is None


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_gather_sdpa_fallback_matches_transformers(request, arch) -> None:
    folder = request.getfixturevalue(f"{arch}_dir")
    prompts = make_prompts(8, seed=8)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    engine = engine_for(folder, device="cuda", dtype="float32", attention_backend="torch")
    outputs = run_engine(engine, prompts, params, arrival_steps=[i for i in range(8)])
    assert [outputs[i] for i in range(8)] == hf_greedy(folder, prompts, 32)


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def test_cuda_seeded_sampling_reproducible(llama_dir) -> None:
    prompts = make_prompts(8, seed=3)

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)

    together = run_engine(engine_for(llama_dir, device="cuda", num_kv_blocks=512), prompts, params)
    alone = run_engine(engine_for(llama_dir, device="cuda", num_kv_blocks=512), prompts[:1], params)
    assert together[0] == alone[0]


def test_cuda_uses_the_triton_decode_kernel(llama_dir) -> None:
    pytest.importorskip("triton")
    engine = engine_for(llama_dir, device="cuda")
    attention = engine.runner.attention
    assert attention.name == "triton" and attention.disabled_reason is None
    run_engine(engine, make_prompts(4, seed=5), SamplingParams(max_tokens=8, temperature=0.0))
    assert attention.disabled_reason is None, "the kernel failed during decoding and fell back"


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 2e-2), ("float16", 5e-3)])
def test_cuda_kernel_matches_gather_sdpa(dtype, tol) -> None:
    pytest.importorskip("triton")
    from tests.backends.torch_llm.paged_kernel_checks import kernel_errors

    errors = kernel_errors("cuda", dtype)
    assert max(errors) < tol, errors


def test_cuda_decode_graphs_match_eager_steps_and_transformers(llama_dir) -> None:
    if not _has_triton():
        pytest.skip("decode graphs need the Triton attention kernel")
    prompts = make_prompts(12, seed=11)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    arrivals = [3 * i for i in range(12)]  # decode batches of every size from 1 to 12, padded ones too
    # two engines at once: fixed pools, not a share of the card each
    graphed = engine_for(llama_dir, device="cuda", dtype="float32", max_num_seqs=12, num_kv_blocks=512)
    eager = engine_for(
        llama_dir, device="cuda", dtype="float32", max_num_seqs=12, num_kv_blocks=512, cuda_graphs="off"
    )
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    assert graphed.runner.graphs.sizes == [1, 2, 4, 8, 12]
    assert max(graphed.runner.graphs.check_errors) < 1e-3  # float32: the load-time check's replays
    with_graphs = run_engine(graphed, prompts, params, arrival_steps=arrivals)
    assert graphed.runner.graphs.replays > 0
    assert with_graphs == run_engine(eager, prompts, params, arrival_steps=arrivals)
    assert [with_graphs[i] for i in range(12)] == hf_greedy(llama_dir, prompts, 40)


def test_cuda_decode_graphs_stay_off_with_lora_layers(llama_dir) -> None:
    engine = engine_for(llama_dir, device="cuda", dtype="float32", enable_lora=True)
    assert engine.runner.graphs is None
