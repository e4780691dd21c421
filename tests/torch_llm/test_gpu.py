"""The correctness suite on CUDA (skipped without a GPU; not run in CI, which has none)."""

from __future__ import annotations

import pytest

from backends.base import SamplingParams
from tests.torch_llm.conftest import engine_for, hf_greedy, make_prompts, run_engine

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


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


def test_cuda_seeded_sampling_reproducible(llama_dir) -> None:
    prompts = make_prompts(8, seed=3)

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)

    together = run_engine(engine_for(llama_dir, device="cuda"), prompts, params)
    alone = run_engine(engine_for(llama_dir, device="cuda"), prompts[:1], params)
    assert together[0] == alone[0]
