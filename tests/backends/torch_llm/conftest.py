"""Fixtures: tiny random-weight models written by `demo.write_tiny_llama`, and a sync engine driver."""

from __future__ import annotations

import pathlib
import random
from collections.abc import Callable

import pytest
import structlog

torch = pytest.importorskip("torch")

from backends.base import SamplingParams  # noqa: E402
from backends.demo_models.tiny_llama import write_tiny_llama  # noqa: E402
from backends.torch_llm.engine import LLMEngine  # noqa: E402
from backends.torch_llm.factory import build_engine  # noqa: E402
from backends.torch_llm.options import LLMOptions  # noqa: E402

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> None:
    """Tiny models run fastest single-threaded; on a shared 2-core box extra threads only contend."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Llama with GQA and Llama-3 rope scaling (original context 32, so scaling matters here)."""
    return write_tiny_llama(
        tmp_path_factory.mktemp("llama"), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        rope_scaling=LLAMA3_ROPE, init_std=0.05, seed=1,
    )  # fmt: skip


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Qwen2-style: biases on q/k/v, tied embeddings, MHA-to-GQA 4:1."""
    return write_tiny_llama(
        tmp_path_factory.mktemp("qwen2"), hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1,
        architecture="qwen2", tie_word_embeddings=True, init_std=0.05, seed=2,
    )  # fmt: skip


def make_prompts(n: int, seed: int, vocab: int = 500) -> list[list[int]]:
    """Mixed lengths (1..70 tokens); a third share a 40-token prefix, so prefix caching has hits."""
    rng = random.Random(seed)
    shared = [0] + [rng.randrange(6, vocab) for _ in range(39)]
    prompts = []
    for i in range(n):
        if i % 3 == 0:
            prompts.append(shared + [rng.randrange(6, vocab) for _ in range(rng.randint(1, 20))])
        else:
            prompts.append([0] + [rng.randrange(6, vocab) for _ in range(rng.randint(0, 69))])
    return prompts


def engine_for(folder: pathlib.Path, device: str = "cpu", **options: object) -> LLMEngine:
    """A sync engine with block size 8 and an 8 MiB KV pool unless `options` say otherwise."""
    opts = LLMOptions(**{"block_size": 8, "kv_cache_bytes": 8 << 20, **options})  # type: ignore[arg-type]
    return build_engine(folder, opts, device=device).engine


def run_engine(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams | Callable[[int], SamplingParams],
    *,
    arrival_steps: list[int] | None = None,
) -> dict[int, list[int]]:
    """Feed prompts (request i at step arrival_steps[i]) and step until all finish."""
    arrival_steps = arrival_steps or [0] * len(prompts)
    outputs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    step = 0
    pending = sorted(range(len(prompts)), key=lambda i: arrival_steps[i])
    while pending or engine.has_unfinished:
        while pending and arrival_steps[pending[0]] <= step:
            i = pending.pop(0)
            p = params(i) if callable(params) else params
            engine.add_request(str(i), prompts[i], p)
        for out in engine.step():
            outputs[int(out.request_id)].extend(out.token_ids)
        step += 1
        assert step < 10_000, "engine made no progress"
    return outputs


def hf_greedy(folder: pathlib.Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Reference: transformers generate(do_sample=False) in float32, one prompt at a time, no EOS stop."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                attention_mask=torch.ones(1, len(p)),
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def serve_without_compiler(
    folder: pathlib.Path, monkeypatch: pytest.MonkeyPatch, module: object, loader: str, event: str
) -> tuple[LLMEngine, list[dict]]:
    """An engine built while `module.loader` fails as without a C++ toolchain (failure injection),
    after serving three short requests greedily; returns it and the `event` warnings it logged."""

    def no_compiler() -> None:
        raise RuntimeError("Error building extension: c++ not found")

    monkeypatch.setattr(module, loader, no_compiler)
    with structlog.testing.capture_logs() as logs:
        engine = engine_for(folder)
        out = run_engine(engine, make_prompts(3, seed=1), SamplingParams(max_tokens=4, temperature=0.0))
    assert all(len(tokens) == 4 for tokens in out.values())
    return engine, [e for e in logs if e["event"] == event]
