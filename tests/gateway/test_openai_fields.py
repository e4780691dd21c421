"""OpenAI request fields are honoured, forwarded or refused by name: never silently dropped.

The own engine applies penalties, logit_bias, min_tokens and output constraints (response_format,
structured_outputs, guided_*) and refuses what it does not implement (a structural tag) with a 400
naming the field; a remote OpenAI upstream receives those fields as sent.
logprobs / top_logprobs come from the own engine or are asked of a remote upstream and handed on (an
upstream answer without them is an error, never silently short); tools / tool_choice reach a remote
upstream as sent and its tool calls come back; the own engine serves them (test_tool_calls.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from backends.demo_models.tiny_llama import write_tiny_llama
from gateway.config import parse_config
from gateway.http.app import create_app
from tests import openai_upstream
from tests.conftest import create_key
from tests.servers import free_port, serve_app

HELLO = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def llm_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("fields") / "tiny-llama")


@pytest.fixture(scope="module")
def tiny_eos(llm_folder: Path) -> int:
    from backends.torch_llm.model.config import ModelConfig

    return ModelConfig.from_folder(llm_folder).eos_token_ids[0]


@pytest.fixture(scope="module")
def both(llm_folder: Path, upstream_url: str) -> Iterator[OpenAI]:
    folder = llm_folder
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments:
  llm: {{backend: torch_llm, model: {folder}, device: cpu, options: {{max_num_seqs: 2}}}}
  up: {{backend: remote, url: {upstream_url}, protocol: openai, model_name: echo-upstream, api_key_env: TEST_UPSTREAM_KEY}}
  down: {{backend: remote, url: "http://127.0.0.1:{free_port()}", protocol: openai, model_name: gone}}
  down2: {{backend: remote, url: "http://127.0.0.1:{free_port()}", protocol: openai, model_name: gone}}
  busy: {{backend: remote, url: {upstream_url}, protocol: openai, model_name: busy-for-seed-1, api_key_env: TEST_UPSTREAM_KEY}}
  broken: {{backend: remote, url: {upstream_url}, protocol: openai, model_name: malformed-tools, api_key_env: TEST_UPSTREAM_KEY}}
  busy2: {{backend: remote, url: {upstream_url}, protocol: openai, model_name: busy-for-seed-1, api_key_env: TEST_UPSTREAM_KEY}}
models:
  tiny: {{routes: [{{deployment: llm}}]}}
  echo: {{routes: [{{deployment: up}}]}}
  tiny-behind-down: {{routes: [{{deployment: down}}], fallback: [llm]}}
  all-down: {{routes: [{{deployment: down}}], fallback: [down2]}}
  half-busy: {{routes: [{{deployment: busy}}], fallback: [busy2]}}
  broken-tools: {{routes: [{{deployment: broken}}]}}
""",
        base_dir=Path("."),
    )
    with serve_app(create_app(config)) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key=create_key(url, "acme"), max_retries=0)


def test_the_own_engine_refuses_what_it_does_not_implement_by_name(both: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        both.chat.completions.create(
            model="tiny", messages=HELLO, max_tokens=2, response_format={"type": "structural_tag"}
        )
    assert "response_format" in info.value.message


def test_the_own_engine_applies_penalties_bias_and_min_tokens(both: OpenAI) -> None:
    baseline = both.completions.create(
        model="tiny", prompt="hello there", max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    ).choices[0].text
    penalized = both.completions.create(
        model="tiny", prompt="hello there", max_tokens=24, temperature=0, frequency_penalty=2.0,
        presence_penalty=1.0, extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    assert penalized != baseline  # greedy repeats in this random model; the penalties break them
    repeated = both.completions.create(
        model="tiny", prompt="hello there", max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True, "repetition_penalty": 5.0},
    ).choices[0].text  # fmt: skip
    assert repeated != baseline
    forced = both.completions.create(
        model="tiny", prompt="hello", max_tokens=5, temperature=0, logit_bias={"7": 100}, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    tokens = forced.choices[0].logprobs.tokens
    assert len(tokens) == 5 and len(set(tokens)) == 1  # token 7, every step
    with pytest.raises(openai.BadRequestError) as info:
        both.completions.create(model="tiny", prompt="hi", max_tokens=2, logit_bias={"999999": 5})
    assert "logit_bias" in info.value.message


def test_min_tokens_hold_back_the_end_of_sequence(both: OpenAI, tiny_eos: int) -> None:
    # the end-of-sequence token is made certain, yet not chosen before min_tokens
    out = both.completions.create(
        model="tiny", prompt="hello", max_tokens=10, temperature=0, logit_bias={str(tiny_eos): 100},
        extra_body={"min_tokens": 4},
    )  # fmt: skip
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "stop"
    early = both.completions.create(
        model="tiny", prompt="hello", max_tokens=10, temperature=0, logit_bias={str(tiny_eos): 100}
    )
    assert early.usage.completion_tokens == 1


def test_neutral_values_are_accepted(both: OpenAI) -> None:
    out = both.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=2, presence_penalty=0, frequency_penalty=0, logit_bias={}
    )
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_missing_from_an_upstream_answer_are_an_error_not_dropped(both: OpenAI, stream: bool) -> None:
    """The echo upstream ignores `logprobs`: the caller gets a clear error, never an answer without them."""
    with pytest.raises(openai.APIStatusError) as info:
        both.chat.completions.create(model="echo", messages=HELLO, max_tokens=2, logprobs=True, stream=stream)
    assert info.value.status_code == 502 and "logprobs" in info.value.message


def test_logprobs_pass_through_a_remote_deployment(both: OpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    """A gateway in front of another gateway's engine hands on the engine's logprobs unchanged, in
    both wire shapes, whole and streamed."""
    monkeypatch.setenv("TEST_CHAIN_KEY", both.api_key)
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments:
  hop: {{backend: remote, url: "{str(both.base_url).removesuffix("/v1/")}", protocol: openai, model_name: tiny, api_key_env: TEST_CHAIN_KEY}}
models:
  tiny-remote: {{routes: [{{deployment: hop}}]}}
""",
        base_dir=Path("."),
    )
    ask = {"max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    with serve_app(create_app(config)) as url:
        front = OpenAI(base_url=f"{url}/v1", api_key=create_key(url, "acme"), max_retries=0)
        for model_name, direct in (("tiny-remote", False), ("tiny", True)):
            client = both if direct else front
            chat = client.chat.completions.create(
                model=model_name, messages=HELLO, logprobs=True, top_logprobs=2, **ask
            ).choices[0].logprobs.content
            streamed = client.chat.completions.create(
                model=model_name, messages=HELLO, logprobs=True, top_logprobs=2, stream=True, **ask
            )
            chunks = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
            legacy = client.completions.create(model=model_name, prompt="hello", logprobs=2, **ask).choices[0].logprobs
            if direct:
                want = (chat, chunks, legacy)
            else:
                got = (chat, chunks, legacy)
    assert len(got[0]) == 6
    for mine, theirs in zip(got[:2], want[:2], strict=True):
        assert [(e.token, e.bytes, round(e.logprob, 5), [t.token for t in e.top_logprobs]) for e in mine] == [
            (e.token, e.bytes, round(e.logprob, 5), [t.token for t in e.top_logprobs]) for e in theirs
        ]
    assert got[2].tokens == want[2].tokens and got[2].top_logprobs == want[2].top_logprobs


TOOLS = [
    {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "reverse", "parameters": {"type": "object"}}},
]


def test_tools_on_an_own_engine_without_a_tool_parser(both: OpenAI) -> None:
    """The own engine serves tools (tests/gateway/test_tool_calls.py); "auto" on a model whose chat
    template has no tool format fleetgate recognises is a 400 naming the option to set, and a
    history with tool calls is rendered, not refused."""
    with pytest.raises(openai.BadRequestError) as info:
        both.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, tools=TOOLS)
    assert "options.tool_parser" in info.value.message
    turn = [*HELLO, {"role": "assistant", "content": None,
                     "tool_calls": [{"id": "c", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]}]  # fmt: skip
    out = both.chat.completions.create(model="tiny", messages=turn, max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"tool_choice": "auto"}, "without `tools`"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "absent"}}}, "absent"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "function"),
    ],
)
def test_malformed_tool_fields_are_400s_naming_them(both: OpenAI, fields: dict, words: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        both.chat.completions.create(model="echo", messages=HELLO, max_tokens=2, **fields)
    assert words.replace("without ", "").strip("`") in info.value.message


def test_tool_requests_are_not_refused_by_a_fallback_that_hides_the_outage(both: OpenAI) -> None:
    """The remote route is down and the fallback (the own engine) cannot take `tools`: the caller
    sees the outage (503), not a 400 that says its request is wrong."""
    with pytest.raises(openai.APIStatusError) as info:
        both.chat.completions.create(model="tiny-behind-down", messages=HELLO, max_tokens=2, tools=TOOLS)
    assert info.value.status_code == 503


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_upstream_tool_calls_are_a_502(both: OpenAI, stream: bool) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        both.chat.completions.create(model="broken-tools", messages=HELLO, max_tokens=2, tools=TOOLS, stream=stream)
    assert info.value.status_code == 502


def test_tool_calls_pass_through_a_remote_deployment(both: OpenAI) -> None:
    """tools and tool_choice reach the upstream as sent; its tool call comes back whole, or as
    stream deltas that join into the same call; the tool's result turn is forwarded on the next call."""
    choice = {"type": "function", "function": {"name": "reverse"}}
    ask = {"model": "echo", "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 8}
    whole = both.chat.completions.create(**ask, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    sent = openai_upstream.RECEIVED[-1]
    assert sent["tools"] == TOOLS and sent["tool_choice"] == choice and sent["parallel_tool_calls"] is False
    answer = whole.choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None
    call = answer.message.tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == ("call_0", "reverse", '{"words":["three","two","one"]}')

    chunks = list(both.chat.completions.create(**ask, tools=TOOLS, stream=True))
    deltas = [d for c in chunks for ch in c.choices for d in ch.delta.tool_calls or []]
    assert len(deltas) == 3 and deltas[0].function.name == "lookup"
    assert "".join(d.function.arguments or "" for d in deltas) == '{"words":["three","two","one"]}'
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]

    result_turn = [
        *ask["messages"],
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": "call_0", "content": "done"},
    ]
    both.chat.completions.create(model="echo", messages=result_turn, max_tokens=8)
    forwarded = openai_upstream.RECEIVED[-1]["messages"]
    assert forwarded[1]["tool_calls"][0]["id"] == "call_0" and forwarded[1]["content"] is None
    assert forwarded[2] == {"role": "tool", "content": "done", "tool_call_id": "call_0"}


def test_chat_logprobs_from_the_engine(both: OpenAI) -> None:
    out = both.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-5  # greedy picks the likeliest
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    assert bytes(b for e in content for b in e.bytes).decode("utf-8", "replace") == out.choices[0].message.content
    streamed = both.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in chunks] == [(e.token, round(e.logprob, 5)) for e in content]


def test_completion_logprobs_from_the_engine(both: OpenAI) -> None:
    out = both.completions.create(
        model="tiny", prompt="hello", max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    with pytest.raises(openai.BadRequestError):
        both.completions.create(model="tiny", prompt="hello", max_tokens=2, logprobs=9)


def test_a_remote_upstream_receives_the_fields_as_sent(both: OpenAI) -> None:
    out = both.chat.completions.create(
        model="echo",
        messages=HELLO,
        max_tokens=3,
        presence_penalty=0.5,
        logit_bias={"7": -100},
        response_format={"type": "json_object"},
        extra_body={"repetition_penalty": 1.1, "min_tokens": 1},
    )
    assert out.choices[0].message.content
    sent = openai_upstream.RECEIVED[-1]
    assert sent["response_format"] == {"type": "json_object"}
    vllm = {"structured_outputs": {"json": '{"type": "integer"}', "disable_any_whitespace": True}}
    both.chat.completions.create(model="echo", messages=HELLO, max_tokens=3, extra_body=vllm)
    assert {k: openai_upstream.RECEIVED[-1][k] for k in vllm} == vllm
    both.completions.create(model="echo", prompt="hi", max_tokens=3, extra_body={"guided_choice": ["a", "b"]})
    assert openai_upstream.RECEIVED[-1]["guided_choice"] == ["a", "b"]
    assert sent["presence_penalty"] == 0.5 and sent["logit_bias"] == {"7": -100}
    assert sent["response_format"] == {"type": "json_object"}
    assert sent["repetition_penalty"] == 1.1 and sent["min_tokens"] == 1


def _usage_tokens(both: OpenAI, model: str) -> tuple[int, int]:
    import httpx

    from tests.conftest import ADMIN_HEADERS

    url = str(both.base_url).removesuffix("/").removesuffix("/v1")
    rows = httpx.get(f"{url}/admin/usage", params={"tenant": "acme"}, headers=ADMIN_HEADERS).json()["usage"]
    day = [r for r in rows if len(r["period"]) == 10 and r["model"] == model]
    return (day[0]["requests"], day[0]["tokens"]) if day else (0, 0)


@pytest.mark.parametrize("model", ["tiny", "echo"])
def test_n_choices_whole(both: OpenAI, model: str) -> None:
    before = _usage_tokens(both, model)
    out = both.chat.completions.create(
        model=model, messages=HELLO, max_tokens=6, n=3, temperature=1.0, seed=5, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.message.content for c in out.choices)
    if model == "tiny":
        assert len({c.message.content for c in out.choices}) > 1  # seeds 5, 6, 7: different samples
        assert out.usage.completion_tokens == 18
    requests, tokens = _usage_tokens(both, model)
    # one request, charged the prompt once and every choice's completion: what the answer reports
    assert requests - before[0] == 1
    assert tokens - before[1] == out.usage.prompt_tokens + out.usage.completion_tokens


def test_n_choices_streamed(both: OpenAI) -> None:
    stream = both.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=5, n=2, stream=True, stream_options={"include_usage": True},
        temperature=1.0, seed=1, extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] and texts[1] and usage is not None and usage.completion_tokens == 10
    whole = both.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=5, n=2, temperature=1.0, seed=1, extra_body={"ignore_eos": True}
    )
    assert [c.message.content for c in whole.choices] == [texts[0], texts[1]]  # same seeds, same text


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_fall_back_together(both: OpenAI, stream: bool) -> None:
    """The first route's upstream is down: all `n` choices start on the fallback, one answer, and
    the request is charged once for what the answer reports."""
    before = _usage_tokens(both, "tiny-behind-down")
    ask = {"model": "tiny-behind-down", "messages": HELLO, "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 2}
    if stream:
        chunks = list(
            both.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True})
        )  # fmt: skip
        assert {c.index for chunk in chunks for c in chunk.choices} == {0, 1, 2}
        usage = next(chunk.usage for chunk in chunks if chunk.usage is not None)
    else:
        out = both.chat.completions.with_raw_response.create(**ask, extra_body={"ignore_eos": True})
        assert out.headers["x-fleetgate-deployment"].startswith("llm")
        answer = out.parse()
        assert [c.index for c in answer.choices] == [0, 1, 2]
        usage = answer.usage
    assert usage.completion_tokens == 12
    requests, tokens = _usage_tokens(both, "tiny-behind-down")
    assert (requests - before[0], tokens - before[1]) == (1, usage.prompt_tokens + usage.completion_tokens)


@pytest.mark.parametrize("model", ["all-down", "half-busy"])
def test_n_choices_that_no_deployment_can_start_cost_nothing(both: OpenAI, model: str) -> None:
    """Every route down, or every route refusing the second choice after the first started: a 503,
    and no usage and no request counted (as for a single request that never started)."""
    before = _usage_tokens(both, model)
    with pytest.raises(openai.APIStatusError) as info:
        both.chat.completions.create(model=model, messages=HELLO, max_tokens=4, n=3, seed=0)
    assert info.value.status_code == 503
    assert _usage_tokens(both, model) == before


def test_n_is_bounded(both: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        both.chat.completions.create(model="tiny", messages=HELLO, max_tokens=2, n=99)
    assert "`n`" in info.value.message


def test_n_choices_stream_cut_by_the_client_settles_everything(llm_folder: Path) -> None:
    """A client that leaves an `n` = 3 stream early: every choice is aborted, the one queue turn is
    given back and the request is charged once, for what was generated."""
    import time

    import httpx

    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments:
  llm: {{backend: torch_llm, model: {llm_folder}, device: cpu, options: {{max_num_seqs: 4}}}}
models:
  tiny: {{routes: [{{deployment: llm}}]}}
""",
        base_dir=Path("."),
    )
    app = create_app(config)
    with serve_app(app) as url:
        key = create_key(url, "acme")
        body = {"model": "tiny", "messages": HELLO, "max_tokens": 1500, "n": 3, "stream": True, "ignore_eos": True}
        with httpx.stream(
            "POST",
            f"{url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        ) as response:
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 5:
                    break  # the client goes away mid-stream
        core = app.state.core
        deadline = time.monotonic() + 20
        while core.deployments["llm"].queue.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert core.deployments["llm"].queue.in_flight == 0
        engine = core.deployments["llm"].backend._engine.engine  # noqa: SLF001 - the engine's own state
        while engine.has_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not engine.has_unfinished  # every choice aborted, none runs to 1,500 tokens
        from tests.conftest import ADMIN_HEADERS

        rows = httpx.get(f"{url}/admin/usage", params={"tenant": "acme"}, headers=ADMIN_HEADERS).json()["usage"]
        (day,) = [r for r in rows if len(r["period"]) == 10]
        assert day["requests"] == 1 and 0 < day["tokens"] < 3 * 1500


#: required fields of OpenAI's published API description (openapi.yaml: CreateChatCompletionResponse,
#: ChatCompletionResponseMessage, CreateChatCompletionStreamResponse, CreateCompletionResponse,
#: CompletionUsage); clients generated from it reject an answer that lacks one
_REQUIRED = {
    "chat.completion": {"id", "object", "created", "model", "choices"},
    "chat.completion.choice": {"index", "message", "finish_reason", "logprobs"},
    "chat.completion.message": {"role", "content", "refusal"},
    "chat.completion.chunk": {"id", "object", "created", "model", "choices"},
    "chat.completion.chunk.choice": {"index", "delta", "finish_reason"},
    "text_completion": {"id", "object", "created", "model", "choices"},
    "text_completion.choice": {"index", "text", "finish_reason", "logprobs"},
    "usage": {"prompt_tokens", "completion_tokens", "total_tokens"},
}


def _missing(kind: str, value: dict) -> set[str]:
    return _REQUIRED[kind] - value.keys()


def _sse_chunks(text: str) -> list[dict]:
    import json

    lines = [line.removeprefix("data: ") for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_the_own_engines_answers_carry_every_field_openai_describes(both: OpenAI) -> None:
    """Chat (whole and streamed) and completions (whole and streamed) from the own engine: every
    required field, `message.refusal` null as OpenAI sends it, and the first delta's role."""
    import httpx

    url, headers = str(both.base_url).rstrip("/"), {"Authorization": f"Bearer {both.api_key}"}
    chat = {"model": "tiny", "messages": HELLO, "max_tokens": 3}
    with httpx.Client(headers=headers, timeout=60) as http:
        whole = http.post(f"{url}/chat/completions", json=chat).json()
        assert _missing("chat.completion", whole) == set() and whole["object"] == "chat.completion"
        (choice,) = whole["choices"]
        assert _missing("chat.completion.choice", choice) == set()
        assert _missing("chat.completion.message", choice["message"]) == set()
        assert choice["message"]["refusal"] is None and choice["message"]["role"] == "assistant"
        assert _missing("usage", whole["usage"]) == set()

        opts = {"stream": True, "stream_options": {"include_usage": True}}
        chunks = _sse_chunks(http.post(f"{url}/chat/completions", json={**chat, **opts}).text)
        for chunk in chunks:
            assert _missing("chat.completion.chunk", chunk) == set(), chunk
            for c in chunk["choices"]:
                assert _missing("chat.completion.chunk.choice", c) == set(), chunk
        first = chunks[0]["choices"][0]["delta"]
        assert first["role"] == "assistant" and first["refusal"] is None
        assert chunks[-1]["choices"] == [] and _missing("usage", chunks[-1]["usage"]) == set()

        text = {"model": "tiny", "prompt": "hello", "max_tokens": 3}
        done = http.post(f"{url}/completions", json=text).json()
        assert _missing("text_completion", done) == set() and _missing("usage", done["usage"]) == set()
        assert _missing("text_completion.choice", done["choices"][0]) == set()
        for chunk in _sse_chunks(http.post(f"{url}/completions", json={**text, "stream": True}).text):
            assert _missing("text_completion", chunk) == set(), chunk
            assert _missing("text_completion.choice", chunk["choices"][0]) == set(), chunk
