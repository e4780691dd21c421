"""The torch_llm engine behind the gateway: OpenAI endpoints, usage from the engine, the fair queue gate."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from backends.torch_llm.demo import write_tiny_llama
from gateway.app import create_app
from gateway.config import parse_config
from tests.conftest import create_key
from tests.servers import serve_app


@pytest.fixture(scope="module")
def llm_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    folder = write_tiny_llama(tmp_path_factory.mktemp("llm") / "tiny-llama")
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants:
  acme: {{limits: {{tokens_per_minute: 100000}}}}
deployments:
  llm: {{backend: torch_llm, model: {folder}, device: cpu, options: {{max_num_seqs: 2}}}}
models:
  tiny: {{routes: [{{deployment: llm}}]}}
""",
        base_dir=Path("."),
    )
    with serve_app(create_app(config)) as url:
        yield url, create_key(url, "acme")


def test_chat_and_completion_with_engine_usage(llm_gateway):
    url, key = llm_gateway
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens > 0
    again = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].message.content == out.choices[0].message.content  # greedy is deterministic


def test_streaming_text_equals_non_streaming(llm_gateway):
    url, key = llm_gateway
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    args = {
        "model": "tiny",
        "prompt": "the quick brown fox",
        "max_tokens": 8,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.completions.create(**args).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 8


def test_more_requests_than_engine_slots_all_complete(llm_gateway):
    """max_num_seqs=2: the fair queue holds the rest and releases them as slots free up."""
    url, key = llm_gateway

    async def one(client: httpx.AsyncClient, i: int) -> int:
        r = await client.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": f"request {i}", "max_tokens": 4, "ignore_eos": True},
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        return r.json()["usage"]["completion_tokens"]

    async def main() -> list[int]:
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    assert asyncio.run(main()) == [4] * 8


def test_prompt_too_long_is_400(llm_gateway):
    url, key = llm_gateway
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": "word " * 5000, "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
