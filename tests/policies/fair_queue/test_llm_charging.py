"""VTC charges an LLM request as its tokens are delivered: the request path's generation stream.

Runs the real torch_llm engine (a tiny random-weight Llama) behind the deployment's fair queue,
through `GatewayCore.start_generation`, as the OpenAI endpoints do.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from backends.demo_models.tiny_llama import write_tiny_llama
from tests.gateway.test_stream_accounting import PROMPT, llm_request, llm_yaml, open_core, start


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("llm") / "tiny-llama")


async def test_service_is_charged_per_token_while_streaming(model_dir: Path) -> None:
    async with open_core(llm_yaml(model_dir)) as core:
        queue = core.deployments["llm"].queue
        events = await start(core, "tiny", llm_request("r1", max_tokens=6))
        seen, charged = 0, []
        async for event in events:
            seen += len(event.token_ids)
            charged.append((seen, queue.stats().tenants["acme"].service))
        assert seen == 6
        # at the first event the charge is rebased from prompt + max_tokens to the prompt, then
        # +2 per output token as it is handed out
        assert all(service == len(PROMPT) + 2 * n for n, service in charged)
        # the release settles the exact total, once (no second charge of the output)
        assert queue.stats().tenants["acme"].service == len(PROMPT) + 2 * 6
        assert queue.in_flight == 0


async def test_running_streams_are_charged_what_each_has_delivered(model_dir: Path) -> None:
    """Two streams in flight together, then both closed early: the counter follows delivery."""
    async with open_core(llm_yaml(model_dir)) as core:
        queue = core.deployments["llm"].queue
        long_ = await start(core, "tiny", llm_request("long", max_tokens=20))
        short = await start(core, "tiny", llm_request("short", max_tokens=20))
        for _ in range(8):
            await anext(long_)
        await anext(short)
        # the generous max_tokens of both reservations is no longer counted
        assert queue.stats().tenants["acme"].service == 2 * len(PROMPT) + 2 * (8 + 1)
        await asyncio.gather(long_.aclose(), short.aclose())
        assert queue.stats().tenants["acme"].service == 2 * len(PROMPT) + 2 * (8 + 1)
        assert queue.in_flight == 0
