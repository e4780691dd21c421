"""Greedy output is token-identical to Hugging Face transformers, whatever the batching does."""

from __future__ import annotations

import pathlib
import random

import pytest

from backends.base import SamplingParams
from tests.backends.torch_llm.conftest import engine_for, hf_greedy, make_prompts, run_engine

N_PROMPTS, N_TOKENS = 32, 64
GREEDY = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(N_PROMPTS, seed=7)


@pytest.fixture(scope="module")
def reference(request: pytest.FixtureRequest, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    return {
        "llama": hf_greedy(request.getfixturevalue("llama_dir"), prompts, N_TOKENS),
        "qwen2": hf_greedy(request.getfixturevalue("qwen2_dir"), prompts, N_TOKENS),
    }


def _folder(request: pytest.FixtureRequest, arch: str) -> pathlib.Path:
    return request.getfixturevalue(f"{arch}_dir")


def _assert_same(outputs: dict[int, list[int]], reference: list[list[int]]) -> None:
    mismatched = [i for i, ref in enumerate(reference) if outputs[i] != ref]
    assert not mismatched, f"prompts {mismatched} differ from transformers"
    assert all(len(o) == N_TOKENS for o in outputs.values())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_all_at_once(request, arch, prompts, reference) -> None:
    engine = engine_for(_folder(request, arch))
    _assert_same(run_engine(engine, prompts, GREEDY), reference[arch])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_staggered_chunked_prefill_with_prefix_cache(request, arch, prompts, reference) -> None:
    # A 16-token budget splits every prompt longer than 16 tokens into chunks, and steps that also
    # run decodes take at most 6 prompt tokens (chunks of 1..6 tokens beside decodes).
    engine = engine_for(
        _folder(request, arch), max_num_batched_tokens=16, max_prefill_tokens_with_decodes=6,
        enable_prefix_caching=True,
    )  # fmt: skip
    arrivals = sorted(random.Random(3).randrange(0, 200) for _ in prompts)
    _assert_same(run_engine(engine, prompts, GREEDY, arrival_steps=arrivals), reference[arch])
    assert engine.num_prefix_hits > 0, "shared prefixes should hit the prefix cache"
    chunked = [i for i, p in enumerate(prompts) if len(p) > 16]
    assert chunked, "the prompt set must contain prompts longer than the token budget"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_pool_preempts_and_still_matches(request, arch, prompts, reference) -> None:
    # 40 blocks x 8 tokens: a handful of sequences fill the pool, so running ones get preempted.
    engine = engine_for(_folder(request, arch), num_kv_blocks=40, max_num_batched_tokens=64)
    _assert_same(run_engine(engine, prompts, GREEDY), reference[arch])
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 40


def test_prefix_cache_is_isolated_per_tenant(llama_dir) -> None:
    engine = engine_for(llama_dir)
    prompt = list(range(6, 60))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for rid, scope in [("a1", "acme"), ("b1", "beta"), ("a2", "acme")]:
        before = engine.num_prefix_hits
        engine.add_request(rid, prompt, params, cache_scope=scope)
        while engine.has_unfinished:
            engine.step()
        hits = engine.num_prefix_hits - before
        assert hits == (48 if rid == "a2" else 0), (rid, hits)
