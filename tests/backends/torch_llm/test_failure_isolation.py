"""A failure inside a step ends only the request it concerns; malformed requests never join a step."""

from __future__ import annotations

import pytest

from backends.base import SamplingParams
from backends.torch_llm.engine import LLMEngine, RequestOutput
from tests.backends.torch_llm.conftest import engine_for

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _drain(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(200):
        if not engine.has_unfinished:
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def _twin_engines(llama_dir, odd_one: str) -> tuple[LLMEngine, LLMEngine]:  # type: ignore[no-untyped-def]
    """Two engines given the same three requests ("a", `odd_one`, "b"): one to break, one as the reference."""
    engines = (engine_for(llama_dir), engine_for(llama_dir))
    for engine in engines:
        for rid, ids in {"a": [1, 5, 9, 14], odd_one: [2, 6, 10], "b": [3, 7, 11, 15, 19]}.items():
            engine.add_request(rid, ids, GREEDY)
    return engines


def _tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize("bad", [[7.25], [True, 3], [3, -1], [10**9], []])
def test_add_refuses_prompts_that_are_not_token_ids(llama_dir, bad) -> None:
    engine = engine_for(llama_dir)
    with pytest.raises(ValueError):
        engine.add_request("bad", bad, GREEDY)
    assert not engine.has_unfinished


@pytest.mark.parametrize("seed", [2**70, -(2**70)])
def test_add_refuses_seeds_a_generator_cannot_take(llama_dir, seed) -> None:
    engine = engine_for(llama_dir)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=seed)
    with pytest.raises(ValueError, match="seed"):
        engine.add_request("bad", [1, 2, 3], params)


def test_a_failing_detokeniser_fails_only_its_request(llama_dir) -> None:
    engine, reference = _twin_engines(llama_dir, "victim")
    calls = 0
    original = engine._seqs["victim"].data.detok.add

    def breaks_on_third_token(token: int) -> bool:  # failure injection: the detokeniser raises
        nonlocal calls
        calls += 1
        if calls == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(token)

    engine._seqs["victim"].data.detok.add = breaks_on_third_token
    got, want = _drain(engine), _drain(reference)
    assert got["victim"][-1].finish_reason == "error" and got["victim"][-1].error
    assert len(_tokens(got["victim"])) == 2
    for rid in ("a", "b"):
        assert got[rid][-1].finish_reason == "length"
        assert _tokens(got[rid]) == _tokens(want[rid]) and len(_tokens(got[rid])) == 12
    assert engine.block_manager.num_free_blocks == reference.block_manager.num_free_blocks


def test_a_failing_forward_is_retried_one_request_at_a_time(llama_dir) -> None:
    engine, reference = _twin_engines(llama_dir, "poison")
    execute = engine.runner.execute
    poisoned = engine._seqs["poison"]

    def fails_with_poison(scheduled):  # failure injection: the forward raises whenever "poison" is in it
        if any(seq is poisoned and seq.num_output_tokens >= 4 for seq, _ in scheduled):
            raise RuntimeError("injected kernel failure")
        return execute(scheduled)

    engine.runner.execute = fails_with_poison
    got, want = _drain(engine), _drain(reference)
    assert got["poison"][-1].finish_reason == "error"
    assert _tokens(got["poison"]) == _tokens(want["poison"])[:4]
    for rid in ("a", "b"):
        assert _tokens(got[rid]) == _tokens(want[rid]) and got[rid][-1].finish_reason == "length"
    assert engine.block_manager.num_free_blocks == reference.block_manager.num_free_blocks
