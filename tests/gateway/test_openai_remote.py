"""OpenAI endpoints through the remote backend to a second local server, with the openai SDK."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import APIStatusError, AuthenticationError, BadRequestError, NotFoundError, OpenAI

from gateway.core.streams import estimate_text_tokens
from tests.conftest import ADMIN_KEY
from tests.openai_upstream import reply_words

PROMPT = "one two three four five six"


@pytest.fixture(scope="module")
def client(gateway):  # type: ignore[no-untyped-def]
    return OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.key, max_retries=0)


def test_list_models_shows_only_what_the_key_may_see(gateway, client):
    assert {m.id for m in client.models.list()} == {"digits", "echo", "echo-broken"}
    other = OpenAI(base_url=f"{gateway.url}/v1", api_key=gateway.other_key, max_retries=0)
    assert {m.id for m in other.models.list()} == {"echo", "echo-broken"}


def test_completion_plain(client):
    out = client.completions.create(model="echo", prompt=PROMPT, max_tokens=4)
    assert out.choices[0].text == " ".join(reply_words(PROMPT, 4))
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == 6 and out.usage.completion_tokens == 4


def test_chat_plain(client):
    out = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": PROMPT}], max_tokens=10
    )
    assert out.choices[0].message.content == " ".join(reply_words(PROMPT, 10))
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "stop"


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model="echo",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " ".join(reply_words(PROMPT, 3))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3


def test_completion_streaming(client):
    stream = client.completions.create(model="echo", prompt=PROMPT, max_tokens=50, stream=True)
    text = "".join(c.choices[0].text for c in stream)
    assert text == " ".join(reply_words(PROMPT, 50))


def test_sse_wire_format_ends_with_done(gateway):
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/completions",
        json={"model": "echo", "prompt": "a b", "stream": True},
        headers=gateway.headers(),
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_stream_breaking_midway_ends_with_error_event(gateway):
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/completions",
        json={"model": "echo", "prompt": "a b c fail-midway", "stream": True},
        headers=gateway.headers(),
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert '"error"' in lines[-2]


def test_upstream_404_maps_to_clean_error(client):
    with pytest.raises(NotFoundError, match="upstream answered 404"):
        client.completions.create(model="echo-broken", prompt="x")


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"n": 99}, "`n` must be in 1..16"),
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_parameters_are_400(client, kwargs, needle):
    with pytest.raises(BadRequestError, match=needle):
        client.completions.create(model="echo", prompt="x", **kwargs)


def test_errors_use_openai_envelope(gateway, client):
    with pytest.raises(NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{gateway.url}/v1", api_key="fg-abc-def", max_retries=0).models.list()
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=b"{",
        headers={**gateway.headers(), "content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_tensor_model_on_text_endpoint_is_400(client):
    with pytest.raises(APIStatusError) as info:
        client.completions.create(model="digits", prompt="x")
    assert info.value.status_code == 400


def test_model_version_syntax(client):
    with pytest.raises(NotFoundError, match="no version"):
        client.completions.create(model="echo:7", prompt="x")


def _echo_usage(gateway) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(requests, tokens) of tenant acme on model echo today."""
    r = httpx.get(
        f"{gateway.url}/admin/usage",
        params={"tenant": "acme"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    rows = [u for u in r.json()["usage"] if u["model"] == "echo" and len(u["period"]) == 10]
    return (rows[0]["requests"], rows[0]["tokens"]) if rows else (0, 0)


def test_client_disconnecting_mid_stream_pays_what_it_was_sent(gateway):
    """The upstream sends no token ids and its usage comes last: the gateway estimates from text."""
    words = [f"w{i:04d}" for i in range(3000)]  # ~3 s of upstream stream, one word per event
    prompt = " ".join(words)
    requests, tokens = _echo_usage(gateway)
    with httpx.stream(
        "POST",
        f"{gateway.url}/v1/completions",
        json={"model": "echo", "prompt": prompt, "max_tokens": 3000, "stream": True},
        headers=gateway.headers(),
    ) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]  # three events, then the client goes away
    assert sum(line.startswith("data: {") for line in received) >= 3
    deadline = time.monotonic() + 10
    while _echo_usage(gateway)[0] == requests and time.monotonic() < deadline:
        time.sleep(0.05)
    new_requests, new_tokens = _echo_usage(gateway)
    assert new_requests == requests + 1
    # the prompt estimate (4 bytes per token) plus the estimate of the text that was sent, which is
    # at least the three events read and far less than the whole answer
    prompt_est = estimate_text_tokens(prompt)
    assert prompt_est + estimate_text_tokens(" w2999 w2998") < new_tokens - tokens
    assert new_tokens - tokens < prompt_est + estimate_text_tokens(prompt) // 2
