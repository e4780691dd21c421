"""Cheap before costly: a tenant whose queue is full is refused before its body is read; an
oversized prompt is refused before it is tokenized."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backends.demo_models.digits import DigitsModel
from backends.demo_models.tiny_llama import write_tiny_llama
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import create_key
from tests.servers import serve_app

ROW = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]}


@pytest.fixture(scope="module")
def held_gateway(digits: DigitsModel) -> Iterator[tuple[str, str, asyncio.Event]]:
    """One slot, one queue place per tenant; the runtime waits until the test releases it."""
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{t: {{}}}}
deployments:
  digits: {{backend: onnxruntime, model: {digits.onnx_path}, queue: {{max_concurrency: 1, max_queue_per_tenant: 1}}}}
models: {{digits: {{routes: [{{deployment: digits}}]}}}}
""",
        base_dir=Path("."),
    )
    app = create_app(config)
    with serve_app(app) as url:
        backend = app.state.core.deployments["digits"].backend
        infer, gate = backend.infer, {"event": None}

        async def held(request):  # type: ignore[no-untyped-def]  # failure injection: a slow runtime
            if gate["event"] is not None:
                await gate["event"].wait()
            return await infer(request)

        backend.infer = held
        yield url, create_key(url, "t"), gate


async def test_a_full_tenant_queue_refuses_before_reading_the_body(held_gateway) -> None:
    url, key, gate = held_gateway
    gate["event"] = asyncio.Event()
    auth = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        held = [asyncio.create_task(client.post("/v2/models/digits/infer", json=ROW, headers=auth)) for _ in range(2)]
        await asyncio.sleep(0.5)  # one in service, one queued: the tenant's queue is full
        host, port = url.removeprefix("http://").split(":")
        # headers promising a megabyte that never comes: a server reading the body would wait for it
        head = (
            f"POST /v2/models/digits/infer HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1048576\r\n\r\n"
        ).encode()
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(head)
            answer = sock.recv(4096).decode("latin-1")
        assert answer.startswith("HTTP/1.1 429"), answer
        assert "tenant_queue_full" in answer or "queue" in answer
        gate["event"].set()
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
    gate["event"] = None


def test_a_prompt_far_beyond_the_context_is_refused_before_tokenizing(tmp_path_factory) -> None:
    folder = write_tiny_llama(tmp_path_factory.mktemp("llm") / "tiny-llama")
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{t: {{}}}}
deployments: {{llm: {{backend: torch_llm, model: {folder}, device: cpu}}}}
models: {{tiny: {{routes: [{{deployment: llm}}]}}}}
""",
        base_dir=Path("."),
    )
    app = create_app(config)
    with serve_app(app) as url:
        tokenizer = app.state.core.deployments["llm"].backend._parts.tokenizer
        calls = {"n": 0}
        encode = tokenizer.encode

        def counting_encode(text, *args, **kwargs):  # type: ignore[no-untyped-def]  # a spy
            calls["n"] += 1
            return encode(text, *args, **kwargs)

        tokenizer.encode = counting_encode
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "word " * 400_000, "max_tokens": 2},
            headers={"Authorization": f"Bearer {create_key(url, 't')}"},
            timeout=30,
        )
        assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
        assert calls["n"] == 0
