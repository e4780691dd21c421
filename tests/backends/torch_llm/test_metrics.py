"""Engine metrics land in the default Prometheus registry, labelled by deployment."""

from __future__ import annotations

from prometheus_client import REGISTRY

from backends.base import SamplingParams
from backends.torch_llm.options import LLMOptions
from tests.backends.torch_llm.conftest import make_prompts, run_engine


def value(name: str, deployment: str) -> float:
    return REGISTRY.get_sample_value(name, {"deployment": deployment}) or 0.0


def test_engine_metrics_and_kv_waste(llama_dir) -> None:
    from backends.torch_llm.factory import build_engine

    opts = LLMOptions(block_size=8, num_kv_blocks=30, max_num_batched_tokens=32)
    engine = build_engine(llama_dir, opts, device="cpu", deployment="metrics-test").engine
    prompts = make_prompts(12, seed=9)
    run_engine(engine, prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    d = "metrics-test"
    assert value("fleetgate_llm_generation_tokens_total", d) == 12 * 20
    assert value("fleetgate_llm_prompt_tokens_total", d) == sum(len(p) for p in prompts)
    assert value("fleetgate_llm_num_preemptions_total", d) == engine.scheduler.num_preemptions > 0
    assert value("fleetgate_llm_time_to_first_token_seconds_count", d) == 12
    assert value("fleetgate_llm_inter_token_latency_seconds_count", d) == 12 * 19
    assert value("fleetgate_llm_e2e_request_latency_seconds_count", d) == 12
    assert value("fleetgate_llm_prefix_cache_queries_total", d) >= sum(len(p) for p in prompts)
    assert value("fleetgate_llm_prefix_cache_hits_total", d) == engine.num_prefix_hits > 0
    assert value("fleetgate_llm_num_requests_running", d) == 0
    assert (
        REGISTRY.get_sample_value(
            "fleetgate_llm_request_success_total", {"deployment": d, "finished_reason": "length"}
        )
        == 12
    )
    # Paging wastes at most the tail of each sequence's last block; reserving max length wastes most.
    w = engine.kv_waste
    assert 0.0 <= w.ratio() < 0.25 < w.ratio(w.reserved_max_len)
