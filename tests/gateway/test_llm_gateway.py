"""The torch_llm engine behind the gateway: OpenAI endpoints, usage from the engine, the fair queue gate."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from backends.base import GenerateRequest
from backends.demo_models.tiny_llama import write_tiny_llama
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import ADMIN_HEADERS, create_key
from tests.servers import serve_app


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("llm") / "tiny-llama")


def _config(folder: Path):  # type: ignore[no-untyped-def]
    return parse_config(
        f"""
state: {{url: "memory://"}}
tenants:
  acme: {{limits: {{tokens_per_minute: 100000}}}}
  cacher: {{}}
deployments:
  llm: {{backend: torch_llm, model: {folder}, device: cpu, options: {{max_num_seqs: 2}}}}
models:
  tiny: {{routes: [{{deployment: llm}}]}}
  tiny-priced:
    routes: [{{deployment: llm}}]
    pricing: {{input_usd_per_mtok: 4.0, cached_input_usd_per_mtok: 1.0, output_usd_per_mtok: 8.0}}
""",
        base_dir=Path("."),
    )


@pytest.fixture(scope="module")
def llm_gateway(model_dir: Path) -> Iterator[tuple[str, str]]:
    with serve_app(create_app(_config(model_dir))) as url:
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


def test_a_prompt_served_from_the_prefix_cache_is_reported_and_priced_as_cached(llm_gateway):
    """The engine's prefix cache serves a repeated prompt's full blocks: the second answer says how
    many in OpenAI's `prompt_tokens_details.cached_tokens`, and those take the cached-input price."""
    url, _ = llm_gateway
    client = OpenAI(base_url=f"{url}/v1", api_key=create_key(url, "cacher"), max_retries=0)
    prompt = "a long shared system prompt that many requests of one tenant repeat word for word " * 4
    args = {"model": "tiny-priced", "prompt": prompt, "max_tokens": 3, "temperature": 0, "extra_body": {"ignore_eos": True}}
    first = client.completions.create(**args).usage
    assert first.prompt_tokens_details is None  # nothing was cached yet: the field is left out
    second = client.completions.create(**args).usage
    cached = second.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.prompt_tokens == first.prompt_tokens
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    rows = httpx.get(f"{url}/admin/usage", params={"tenant": "cacher"}, headers=ADMIN_HEADERS).json()["usage"]
    (day,) = [r for r in rows if len(r["period"]) == len("2026-11-21")]
    prompt_tokens, output = first.prompt_tokens, 3 * 3
    expected = (prompt_tokens * 4.0 + 2 * ((prompt_tokens - cached) * 4.0 + cached * 1.0) + output * 8.0) / 1e6
    assert day["cost_usd"] == pytest.approx(expected, abs=1e-9)


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


@asynccontextmanager
async def _lifespan(app: Any) -> AsyncIterator[None]:
    """Run the app's ASGI lifespan in this event loop (the app is then called directly)."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    await inbox.put({"type": "lifespan.startup"})
    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, inbox.get, outbox.put))
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await task


async def test_stream_is_settled_when_the_client_leaves_during_a_blocked_send(model_dir: Path) -> None:
    """The disconnect cancels the server while it waits on a full socket, not on the stream.

    The transport is a double: its first body `send` blocks (a client that stopped reading) and
    `receive` then reports the disconnect. The SSE generator is left suspended at a `yield`; the
    response must still abort the generation and settle before the app call returns.
    """
    app = create_app(_config(model_dir))
    async with _lifespan(app):
        core = app.state.core
        _, secret = await core.keys.create("acme")
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        sent_one, never = asyncio.Event(), asyncio.Event()
        request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
        chunks: list[bytes] = []

        async def receive() -> dict[str, Any]:
            if request:
                return request.pop()
            await sent_one.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                chunks.append(message["body"])
                sent_one.set()
                await never.wait()

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": "/v1/completions",
            "raw_path": b"/v1/completions",
            "root_path": "",
            "query_string": b"",
            "headers": [
                (b"authorization", f"Bearer {secret}".encode()),
                (b"content-type", b"application/json"),
            ],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        await asyncio.wait_for(app(scope, receive, send), 60)
        assert len(chunks) == 1 and chunks[0].startswith(b"data: {")
        dep = core.deployments["llm"]
        assert dep.queue.in_flight == 0  # settled by the response itself, not by garbage collection
        prompt = await dep.backend.count_prompt_tokens(GenerateRequest(request_id="n", prompt="hello"))
        rows = [r for r in await core.admission.usage("acme") if len(r.period) == 10]
        assert [(r.requests, r.tokens) for r in rows] == [(1, prompt + 1)]  # the one token it was sent


def test_engine_metrics_are_also_exported_under_vllms_names(llm_gateway):
    """vLLM dashboards and KEDA scalers read `vllm:*{model_name=...}`: the same samples as fleetgate_llm_*."""
    from prometheus_client.parser import text_string_to_metric_families

    url, key = llm_gateway
    client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    text = httpx.get(f"{url}/metrics", headers=ADMIN_HEADERS).text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert value(f"vllm:{name}", model_name="llm") == value(f"fleetgate_llm_{name}", deployment="llm")
    assert value("vllm:gpu_cache_usage_perc", model_name="llm") == value("vllm:kv_cache_usage_perc", model_name="llm")
    for name in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    ):
        count = value(f"vllm:{name}_count", model_name="llm")
        assert count >= 1 and count == value(f"fleetgate_llm_{name}_count", deployment="llm")
    assert value("vllm:generation_tokens_total", model_name="llm") >= 3
    assert not any(name.startswith("vllm:kv_cache_waste") for name, _ in samples)
