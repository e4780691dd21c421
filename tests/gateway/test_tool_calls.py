"""Tool calls on the own engine through the running gateway, with the `openai` SDK.

Engines built from saved Qwen2, Llama and Mistral folders carrying their families' tool templates
(`tool_templates`). "required" and named functions are enforced by the grammar, so their arguments
parse and validate against `parameters` at temperature 1.0, whole and streamed; a full round trip
(call, tool result turn, final answer) runs through each family's template; "auto" is read by the
family parser, here from an output a regular expression forces into a `<tool_call>` block (random
weights never write one by themselves).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from backends.demo_models.tiny_llama import write_tiny_llama
from backends.torch_llm.options import decode_options
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import create_key
from tests.gateway.tool_templates import write_tool_model
from tests.servers import serve_app

pytest.importorskip("xgrammar")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"$ref": "#/$defs/unit"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
    "$defs": {"unit": {"type": "string", "enum": ["c", "f"]}},
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "description": "Time in a zone", "parameters": CLOCK}},
]
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}
FAMILIES = ["qwen", "llama", "mistral"]
USER = [{"role": "user", "content": "What is the weather in Paris this week?"}]


@pytest.fixture(scope="module")
def tool_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenAI]:
    root = tmp_path_factory.mktemp("tools")
    folders = {
        "qwen": write_tool_model(root / "qwen", "qwen2", seed=3),
        "llama": write_tool_model(root / "llama", "llama", seed=4),
        "mistral": write_tool_model(root / "mistral", "mistral", seed=5),
        "plain": write_tiny_llama(root / "plain", seed=6),  # a template without tools
    }
    small = "{kv_cache_bytes: 8388608, block_size: 8, max_num_seqs: 4}"
    deployments = "\n".join(
        f"  {name}: {{backend: torch_llm, model: {folder}, device: cpu, options: {small}}}"
        for name, folder in folders.items()
    )
    models = "\n".join(f"  {name}: {{routes: [{{deployment: {name}}}]}}" for name in folders)
    config = parse_config(
        f"state: {{url: 'memory://'}}\ntenants:\n  acme: {{}}\ndeployments:\n{deployments}\nmodels:\n{models}\n",
        base_dir=Path("."),
    )
    with serve_app(create_app(config), timeout_s=240) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key=create_key(url, "acme"), max_retries=0, timeout=120)


def _check_calls(calls: list[dict[str, Any]], names: set[str]) -> None:
    """Every call names a tool of the request, has an id, and arguments that validate."""
    assert calls
    for call in calls:
        assert call["id"] and call["name"] in names, call
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def _whole_calls(message: Any) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]


def _streamed(client: OpenAI, **kwargs: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """Content, calls (deltas joined by index) and finish reason of a streamed answer."""
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name, d  # the first delta
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("model", FAMILIES)
def test_required_calls_validate_whole_and_streamed(tool_gateway: OpenAI, model: str) -> None:
    """Every answer that ends by itself is calls that validate (a random model may also go on
    calling until `max_tokens` cuts it: `length`, as OpenAI reports it)."""
    args = {"model": model, "messages": USER, "tools": TOOLS, "tool_choice": "required", "max_tokens": 300}
    ended = 0
    for seed in range(3):
        out = tool_gateway.chat.completions.create(temperature=1.0, seed=seed, n=2, **args)
        streamed = _streamed(tool_gateway, temperature=1.0, seed=seed, **args)
        answers = [(c.message.content, _whole_calls(c.message), c.finish_reason) for c in out.choices]
        for content, calls, finish in [*answers, streamed]:
            assert finish in ("tool_calls", "length")
            if finish == "tool_calls":
                assert not content
                _check_calls(calls, {"weather", "clock"})
                ended += 1
    assert ended >= 3
    for seed in range(2):
        single = tool_gateway.chat.completions.create(parallel_tool_calls=False, seed=seed, **args).choices[0]
        assert single.finish_reason == "tool_calls" and len(single.message.tool_calls or []) == 1
        _check_calls(_whole_calls(single.message), {"weather", "clock"})


@pytest.mark.parametrize("model", FAMILIES)
def test_a_named_function_is_called_and_finishes_with_stop(tool_gateway: OpenAI, model: str) -> None:
    named = {"type": "function", "function": {"name": "clock"}}
    args = {"model": model, "messages": USER, "tools": TOOLS, "tool_choice": named, "max_tokens": 60}
    out = tool_gateway.chat.completions.create(temperature=1.0, seed=1, **args)
    assert out.choices[0].finish_reason == "stop"  # as OpenAI answers a named function
    calls = _whole_calls(out.choices[0].message)
    assert [c["name"] for c in calls] == ["clock"]
    _check_calls(calls, {"clock"})
    content, streamed, finish = _streamed(tool_gateway, temperature=1.0, seed=1, **args)
    assert finish == "stop" and not content
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]


def _round_trip_messages(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in calls
        ],
    }
    results = [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"ok": True})} for c in calls]
    return [*USER, assistant, *results]


@pytest.mark.parametrize("model", FAMILIES)
@pytest.mark.parametrize("stream", [False, True])
def test_a_full_tool_round_trip(tool_gateway: OpenAI, model: str, stream: bool) -> None:
    """Call, tool result turn, final answer: the assistant's calls and the results go back through
    the family's own template (Llama's takes one call a turn, Mistral's only its 9-character ids)."""
    first = {"model": model, "messages": USER, "tools": TOOLS, "tool_choice": "required",
             "parallel_tool_calls": False, "max_tokens": 120, "seed": 2}  # fmt: skip
    if stream:
        _, calls, finish = _streamed(tool_gateway, **first)
    else:
        out = tool_gateway.chat.completions.create(**first)
        calls, finish = _whole_calls(out.choices[0].message), out.choices[0].finish_reason
    assert finish == "tool_calls"
    _check_calls(calls, {"weather", "clock"})
    final = {"model": model, "messages": _round_trip_messages(calls), "tools": TOOLS, "tool_choice": "none",
             "max_tokens": 8, "seed": 2}  # fmt: skip
    if stream:
        content, more, finish = _streamed(tool_gateway, **final)
    else:
        answer = tool_gateway.chat.completions.create(**final).choices[0]
        content, more, finish = answer.message.content or "", _whole_calls(answer.message), answer.finish_reason
    assert finish in ("stop", "length") and not more and isinstance(content, str)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_reports_a_call_the_model_writes(tool_gateway: OpenAI, stream: bool) -> None:
    """Under "auto" the Qwen deployment's parser (hermes, from its template) reads the call out of
    the output; a regular expression makes the random model write one."""
    block = r'I will check\.\n<tool_call>\n\{"name": "weather", "arguments": \{"city": "(Paris|Oslo)", "days": [1-7]\}\}\n</tool_call>'
    args = {"model": "qwen", "messages": USER, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 300,
            "extra_body": {"structured_outputs": {"regex": block}}}  # fmt: skip
    if stream:
        content, calls, finish = _streamed(tool_gateway, **args)
    else:
        choice = tool_gateway.chat.completions.create(**args).choices[0]
        content, calls, finish = choice.message.content, _whole_calls(choice.message), choice.finish_reason
    assert finish == "tool_calls" and content == "I will check."
    assert [c["name"] for c in calls] == ["weather"]
    _check_calls(calls, {"weather"})


def test_none_shows_no_tools_and_reports_none(tool_gateway: OpenAI) -> None:
    out = tool_gateway.chat.completions.create(
        model="qwen", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=6, seed=0
    )
    assert not out.choices[0].message.tool_calls and out.choices[0].finish_reason in ("stop", "length")


def test_refusals_name_what_to_change(tool_gateway: OpenAI) -> None:
    with pytest.raises(BadRequestError, match="options.tool_parser"):
        tool_gateway.chat.completions.create(model="plain", messages=USER, tools=TOOLS, max_tokens=4)
    with pytest.raises(BadRequestError, match="cannot be combined"):
        tool_gateway.chat.completions.create(
            model="qwen", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=4,
            response_format={"type": "json_object"},
        )  # fmt: skip
    # a deployment without a recognisable template still serves constrained choices
    out = tool_gateway.chat.completions.create(
        model="plain", messages=USER, tools=TOOLS, tool_choice="required", max_tokens=120, seed=0
    )
    _check_calls(_whole_calls(out.choices[0].message), {"weather", "clock"})


def test_an_unknown_tool_parser_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="tool_parser 'qwen' is not one of hermes, llama3_json, mistral"):
        decode_options({"tool_parser": "qwen"})
    assert decode_options({"tool_parser": "mistral"}).tool_parser == "mistral"


def test_the_error_envelope_is_openai_shaped(tool_gateway: OpenAI) -> None:
    r = httpx.post(
        f"{tool_gateway.base_url}chat/completions",
        json={"model": "plain", "messages": USER, "tools": TOOLS},
        headers={"Authorization": f"Bearer {tool_gateway.api_key}"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


#: the constrained-decoding corpus (nested objects, bounded arrays, enums, patterns, formats,
#: ranges, $ref/$defs, anyOf, required, additionalProperties: false); objects can be parameters
CORPUS = {
    path.stem: schema
    for path in sorted((Path(__file__).parents[1] / "backends" / "torch_llm" / "schemas").glob("*.json"))
    if (schema := json.loads(path.read_text())).get("type") == "object"
}


def _corpus_answer(client: OpenAI, name: str, schema: dict[str, Any], stream: bool) -> list[tuple]:
    """(finish, calls) of a named call and of a required one, each function taking `schema`."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}, TOOLS[1]]
    out = []
    for choice in ({"type": "function", "function": {"name": "f"}}, "required"):
        args = {"model": "qwen", "messages": USER, "tools": tools, "tool_choice": choice, "max_tokens": 256,
                "temperature": 1.0, "seed": len(name), "parallel_tool_calls": False}  # fmt: skip
        try:
            if stream:
                _, calls, finish = _streamed(client, **args)
            else:
                answer = client.chat.completions.create(**args).choices[0]
                calls, finish = _whole_calls(answer.message), answer.finish_reason
        except BadRequestError as exc:  # a keyword the engine cannot enforce is refused, by name
            calls, finish = [], f"refused: {exc.message}"
        out.append((choice, finish, calls))
    return out


def test_the_schema_corpus_as_tool_parameters(tool_gateway: OpenAI) -> None:
    """Each object schema of the corpus as a function's `parameters`, at temperature 1.0, named and
    "required", whole or streamed: every call of an answer that ended by itself validates (a schema
    the engine refuses by keyword is no answer)."""
    from concurrent.futures import ThreadPoolExecutor

    assert len(CORPUS) >= 50
    jobs = [(name, i % 2 == 1) for i, name in enumerate(CORPUS)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda job: _corpus_answer(tool_gateway, job[0], CORPUS[job[0]], job[1]), jobs))
    invalid, ended = [], 0
    checker = jsonschema.Draft202012Validator.FORMAT_CHECKER
    for (name, _), answers in zip(jobs, results, strict=True):
        for choice, finish, calls in answers:
            assert finish in ("stop", "tool_calls", "length") or str(finish).startswith("refused"), (name, finish)
            if finish == "length" or str(finish).startswith("refused"):
                continue
            ended += 1
            assert finish == ("stop" if isinstance(choice, dict) else "tool_calls") and len(calls) == 1
            schema = CORPUS[name] if calls[0]["name"] == "f" else CLOCK
            try:
                jsonschema.validate(json.loads(calls[0]["arguments"]), schema, format_checker=checker)
            except (ValueError, jsonschema.ValidationError) as exc:
                invalid.append((name, choice, calls[0]["arguments"], str(exc)[:160]))
    assert invalid == []
    assert ended >= len(jobs)
