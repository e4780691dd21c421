"""What a generation stream is charged when the client reads it all, slowly, partly or not at all.

Through the real request path (`GatewayCore.generation.start`) to the real torch_llm engine (a tiny
random-weight Llama) and to the OpenAI upstream of tests/openai_upstream.py behind the remote
backend. A client that goes away is the protocol layer closing the stream (`aclose`), as it does on
a disconnect; tests/gateway/test_openai_remote.py covers the disconnect over real HTTP.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from backends.base import GenerateRequest, SamplingParams
from backends.demo_models.tiny_llama import write_tiny_llama
from gateway.config import parse_config
from gateway.core.fleet.deployments import build_deployments, close_deployments, open_deployments
from gateway.core.service import GatewayCore
from gateway.core.streams import GenerationStream, estimate_text_tokens
from policies.admission import Admission
from policies.errors import QuotaExceeded
from policies.keys import KeyService
from policies.principal import Principal
from policies.stores import open_store
from router.health import CircuitBreakers
from router.planner import Router

ACME = Principal(tenant="acme", key_id="k-acme")
PROMPT = [5, 6, 7, 8, 9, 10]


@asynccontextmanager
async def open_core(yaml: str) -> AsyncIterator[GatewayCore]:
    """A GatewayCore over a memory store, wired as gateway.http.app's lifespan wires it."""
    config = parse_config(yaml, base_dir=Path("."))
    deployments = build_deployments(config, {n: t.weight for n, t in config.tenants.items()})
    store = await open_store("memory://")
    breakers = CircuitBreakers()
    holder: list[GatewayCore] = []
    router = Router(
        config.models,
        is_healthy=lambda name: deployments[name].ready,
        expected_wait=lambda name: holder[0].expected_wait(name),
    )
    core = GatewayCore(
        config,
        deployments,
        router,
        KeyService(store, time.time, tenants=list(config.tenants)),
        Admission(store, config.tenants, time.time),
        breakers,
    )
    holder.append(core)
    await open_deployments(deployments)
    assert all(d.ready for d in deployments.values()), [d.load_error for d in deployments.values()]
    try:
        yield core
    finally:
        await close_deployments(deployments)
        await store.close()


def llm_yaml(model_dir: Path, acme: str = "{}") -> str:
    return f"""
state: {{url: "memory://"}}
tenants: {{acme: {acme}}}
deployments:
  llm: {{backend: torch_llm, model: {model_dir}, device: cpu, options: {{max_num_seqs: 2}}}}
models:
  tiny: {{routes: [{{deployment: llm}}]}}
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("llm") / "tiny-llama")


def llm_request(rid: str, max_tokens: int) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling, tenant="acme")


async def start(core: GatewayCore, model: str, request: GenerateRequest) -> GenerationStream:
    plan = core.plan(ACME, model, None, None, {})
    events, _ = await core.generation.start(ACME, plan, request, await core.generation.estimate_prompt_tokens(plan, request))
    return events


async def tokens_used(core: GatewayCore) -> int:
    """Tokens recorded for acme today (the day row; the month row holds the same)."""
    return sum(r.tokens for r in await core.admission.usage("acme") if len(r.period) == 10)


async def test_disconnect_mid_stream_pays_prompt_and_delivered_tokens(model_dir: Path) -> None:
    async with open_core(llm_yaml(model_dir)) as core:
        queue = core.deployments["llm"].queue
        events = await start(core, "tiny", llm_request("cut", max_tokens=40))
        delivered = 0
        async for event in events:
            delivered += len(event.token_ids)
            if delivered >= 3:
                break
        await events.aclose()  # what the protocol layer does when the client goes away
        assert 3 <= delivered < 40
        assert await tokens_used(core) == len(PROMPT) + delivered
        assert queue.in_flight == 0
        # VTC settles the same tokens: prompt + 2 x output, counted once
        assert queue.stats().tenants["acme"].service == len(PROMPT) + 2 * delivered


async def test_quota_cannot_be_streamed_past_by_disconnecting(model_dir: Path) -> None:
    """Each request fits the day's quota; disconnected streams still spend it, so it runs out."""
    acme = "{quotas: {tokens_per_day: 60}}"
    async with open_core(llm_yaml(model_dir, acme)) as core:
        with pytest.raises(QuotaExceeded):
            for i in range(30):
                events = await start(core, "tiny", llm_request(f"q{i}", max_tokens=40))
                await anext(events)
                await anext(events)
                await events.aclose()
        # 46 tokens were reserved per request; each closed one cost prompt + 2 delivered
        assert 60 - 46 < await tokens_used(core) <= 60
        assert i >= 2


async def test_stream_never_iterated_settles_when_closed(model_dir: Path) -> None:
    async with open_core(llm_yaml(model_dir)) as core:
        dep = core.deployments["llm"]
        events = await start(core, "tiny", llm_request("idle", max_tokens=30))
        assert dep.queue.in_flight == 1
        await events.aclose()
        assert dep.queue.in_flight == 0
        assert await tokens_used(core) == len(PROMPT)  # nothing was handed out
        # the engine was told: its sequence slots come back
        for _ in range(200):
            if dep.backend.capacity()[0] == 2:  # type: ignore[attr-defined]
                break
            await asyncio.sleep(0.01)
        assert dep.backend.capacity()[0] == 2  # type: ignore[attr-defined]


async def test_slow_reader_does_not_inflate_the_service_time(model_dir: Path) -> None:
    """A stream's service time for least-wait routing is its time to first event."""
    async with open_core(llm_yaml(model_dir)) as core:
        before = time.perf_counter()
        events = await start(core, "tiny", llm_request("slow", max_tokens=3))
        to_first = time.perf_counter() - before
        async for _ in events:
            await asyncio.sleep(0.4)  # the client reads slowly
        assert time.perf_counter() - before > 1.0
        service = core.service_times.get("llm")
        assert service is not None and service <= to_first


# --- remote upstream: events carry text, no token ids ----------------------------------------


def remote_yaml(upstream_url: str) -> str:
    return f"""
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments:
  up:
    backend: remote
    url: {upstream_url}
    protocol: openai
    model_name: echo-upstream
    api_key_env: TEST_UPSTREAM_KEY
models:
  echo: {{routes: [{{deployment: up}}]}}
"""


WORDS = [f"w{i:02d}" for i in range(40)]  # the upstream answers them in reverse, one per event


def remote_request(rid: str, max_tokens: int) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=max_tokens)
    return GenerateRequest(request_id=rid, prompt=" ".join(WORDS), sampling=sampling, tenant="acme")


async def test_remote_stream_is_charged_by_text_estimate_then_exact_usage(upstream_url: str) -> None:
    async with open_core(remote_yaml(upstream_url)) as core:
        queue = core.deployments["up"].queue
        prompt_est = estimate_text_tokens(" ".join(WORDS))
        events = await start(core, "echo", remote_request("r-all", max_tokens=10))
        text, charged = "", []
        async for event in events:
            text += event.text
            if event.finish_reason is None:
                charged.append(queue.stats().tenants["acme"].service)
        # while streaming, VTC sees the output (estimated from text), not the prompt alone
        assert charged[-1] == prompt_est + 2 * estimate_text_tokens(text)
        assert charged == sorted(charged) and charged[-1] > prompt_est
        # the upstream's usage (40 prompt words, 10 output words) settles it exactly, once
        assert queue.stats().tenants["acme"].service == 40 + 2 * 10
        assert await tokens_used(core) == 50


async def test_remote_disconnect_pays_prompt_estimate_and_delivered_estimate(upstream_url: str) -> None:
    async with open_core(remote_yaml(upstream_url)) as core:
        queue = core.deployments["up"].queue
        prompt_est = estimate_text_tokens(" ".join(WORDS))
        events = await start(core, "echo", remote_request("r-cut", max_tokens=40))
        text = ""
        for _ in range(5):
            text += (await anext(events)).text
        await events.aclose()
        delivered = estimate_text_tokens(text)
        assert delivered > 0
        assert await tokens_used(core) == prompt_est + delivered
        assert queue.in_flight == 0
        assert queue.stats().tenants["acme"].service == prompt_est + 2 * delivered
