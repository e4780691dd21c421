"""VTC charges an LLM request as its tokens are produced: the deployment's metered generate.

Runs the real torch_llm engine (a tiny random-weight Llama) behind the deployment's fair queue, and
drives the queue and the stream as the gateway's request path does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from backends.base import GenerateRequest, SamplingParams
from backends.torch_llm.demo import write_tiny_llama
from gateway.config import parse_config
from gateway.deployments import Deployment, build_deployments, close_deployments, open_deployments

PROMPT = [5, 6, 7, 8, 9, 10]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("llm") / "tiny-llama")


@pytest.fixture
async def deployment(model_dir: Path) -> AsyncIterator[Deployment]:
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{acme: {{}}, other: {{}}}}
deployments:
  llm: {{backend: torch_llm, model: {model_dir}, device: cpu, options: {{max_num_seqs: 2}}}}
models:
  tiny: {{routes: [{{deployment: llm}}]}}
""",
        base_dir=Path("."),
    )
    deployments = build_deployments(config, {"acme": 1.0, "other": 1.0})
    await open_deployments(deployments)
    assert deployments["llm"].ready
    yield deployments["llm"]
    await close_deployments(deployments)


def request(rid: str) -> GenerateRequest:
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling)


async def test_service_is_charged_per_token_while_streaming(deployment: Deployment) -> None:
    queue = deployment.queue
    # as the request path does: acquire at prompt + max_tokens, then stream
    ticket = await queue.acquire("acme", len(PROMPT) + MAX_TOKENS)
    assert queue.stats().tenants["acme"].service == len(PROMPT) + MAX_TOKENS
    seen, charged = 0, []
    async for event in deployment.backend.generate(request("r1")):
        seen += len(event.token_ids)
        charged.append((seen, queue.stats().tenants["acme"].service))
    # before release, the counter already holds prompt + 2 x the tokens delivered so far
    assert seen == MAX_TOKENS
    assert all(service == len(PROMPT) + 2 * n for n, service in charged)
    queue.release(ticket, float(len(PROMPT) + 2 * MAX_TOKENS))
    assert queue.stats().tenants["acme"].service == len(PROMPT) + 2 * MAX_TOKENS


async def test_stream_without_a_ticket_of_this_queue_is_not_charged(deployment: Deployment) -> None:
    async for _ in deployment.backend.generate(request("r2")):
        pass
    assert "acme" not in deployment.queue.stats().tenants
