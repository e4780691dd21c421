"""One tenant's malformed or failing generation never ends another tenant's, and never looks like success."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from litestar import Litestar

from backends.demo_models.tiny_llama import write_tiny_llama
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import create_key
from tests.servers import serve_app

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def llm_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Litestar, str, str, str]]:
    folder = write_tiny_llama(tmp_path_factory.mktemp("llm") / "tiny-llama")
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants:
  victim: {{}}
  attacker: {{}}
deployments:
  llm: {{backend: torch_llm, model: {folder}, device: cpu, options: {{max_num_seqs: 8}}}}
models:
  tiny: {{routes: [{{deployment: llm}}]}}
""",
        base_dir=Path("."),
    )
    app = create_app(config)
    with serve_app(app) as url:
        yield app, url, create_key(url, "victim"), create_key(url, "attacker")


async def _victim_stream(client: httpx.AsyncClient, key: str, i: int) -> tuple[int, str | None, bool]:
    """(content chunks received, finish_reason, saw an error event) of one streamed chat."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"story number {i}"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    finish, errored, tokens = None, False, 0
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errored = True
            elif chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                finish = chunk["choices"][0]["finish_reason"]
    return tokens, finish, errored


BAD_COMPLETIONS = [
    {"prompt": [[7.25]]},
    {"prompt": [7.25, 3]},
    {"prompt": [[None]]},
    {"prompt": [[1, 2], [3]]},
    {"prompt": [True, 1]},
    {"prompt": [1, 2], "seed": 2**70},
    {"prompt": [10**12]},
]


async def test_malformed_prompts_get_400_while_other_tenants_streams_finish(llm_app) -> None:
    _, url, victim, attacker = llm_app
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        streams = [asyncio.create_task(_victim_stream(client, victim, i)) for i in range(3)]
        await asyncio.sleep(0.3)  # the victim's generations are running
        for bad in BAD_COMPLETIONS:
            r = await client.post(
                "/v1/completions",
                json={"model": "tiny", "max_tokens": 4, **bad},
                headers={"Authorization": f"Bearer {attacker}"},
            )
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        results = await asyncio.gather(*streams)
    assert results == [(MAX_TOKENS, "length", False)] * 3


async def test_an_engine_failure_is_an_error_never_a_normal_stop(llm_app) -> None:
    app, url, victim, attacker = llm_app
    engine = app.state.core.deployments["llm"].backend._parts.engine
    execute = engine.runner.execute

    def fails_for_the_attacker(scheduled):  # failure injection: the forward fails on one request
        if any(seq.num_prompt_tokens == 3 and seq.num_output_tokens >= 2 for seq, _ in scheduled):
            raise RuntimeError("injected")
        return execute(scheduled)

    engine.runner.execute = fails_for_the_attacker
    try:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            victims = [asyncio.create_task(_victim_stream(client, victim, i)) for i in range(2)]
            await asyncio.sleep(0.2)
            headers = {"Authorization": f"Bearer {attacker}"}
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 30, "ignore_eos": True}
            whole = await client.post("/v1/completions", json=body, headers=headers)
            assert whole.status_code == 500
            assert whole.json()["error"]["code"] == "internal_error"
            assert "injected" not in whole.text  # internals stay in the log
            streamed = await client.post("/v1/completions", json={**body, "stream": True}, headers=headers)
            events = [json.loads(x[6:]) for x in streamed.text.splitlines() if x.startswith("data: {")]
            assert any("error" in e for e in events)
            assert not any(c["finish_reason"] for e in events if "choices" in e for c in e["choices"])
            assert await asyncio.gather(*victims) == [(MAX_TOKENS, "length", False)] * 2
    finally:
        engine.runner.execute = execute


def test_client_request_ids_are_echoed_but_never_used_inside(llm_app) -> None:
    _, url, victim, attacker = llm_app
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    same_id = {"x-request-id": "shared-id-1"}
    with httpx.Client(base_url=url, timeout=60) as client:
        first = client.post(
            "/v1/completions", json=body, headers={**same_id, "Authorization": f"Bearer {victim}"}
        )
        second = client.post(
            "/v1/completions", json=body, headers={**same_id, "Authorization": f"Bearer {attacker}"}
        )
    assert first.status_code == second.status_code == 200
    assert first.headers["x-request-id"] == second.headers["x-request-id"] == "shared-id-1"
    assert first.json()["id"] != second.json()["id"]
    assert "shared-id-1" not in first.json()["id"]
