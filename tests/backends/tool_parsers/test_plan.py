"""A request's tool plan: what the template is shown, the constraint, and how events are read."""

from __future__ import annotations

import json

import pytest

from backends.base import ChatMessage, GenerateRequest, SamplingParams, StructuredOutput, TokenEvent
from backends.errors import InvalidInput
from backends.tool_parsers.plan import ToolPlan, plan_tools, template_messages

TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "clock"}},
]


def _request(choice: object = None, stream: bool = True) -> GenerateRequest:
    return GenerateRequest(request_id="r", prompt="x", tools=TOOLS, tool_choice=choice, stream=stream)  # type: ignore[arg-type]


def _events(plan: ToolPlan, texts: list[str], finish: str = "stop") -> list[TokenEvent]:
    output = plan.output()
    assert output is not None
    last = len(texts) - 1
    return [
        output.rewrite(TokenEvent(request_id="r", text=t, finish_reason=finish if i == last else None))
        for i, t in enumerate(texts)
    ]


def test_auto_reads_calls_with_the_family_parser_and_finishes_with_tool_calls() -> None:
    plan = plan_tools(_request(), "hermes")
    assert plan is not None and plan.render_tools == TOOLS and plan.constraint is None
    events = _events(plan, ["Hi <tool_", 'call>{"name": "clock", "argu', 'ments": {}}</tool_call>'])
    assert "".join(e.text for e in events) == "Hi"
    deltas = [d for e in events for d in e.tool_calls or []]
    assert deltas[0]["function"] == {"name": "clock", "arguments": ""} and deltas[0]["index"] == 0
    assert "".join(d["function"]["arguments"] for d in deltas) == "{}"
    assert events[-1].finish_reason == "tool_calls"


def test_a_whole_answer_gets_whole_calls_on_its_last_event() -> None:
    plan = plan_tools(_request(stream=False), "hermes")
    assert plan is not None
    events = _events(plan, ['<tool_call>{"name": "weather", "arguments": {"a": 1}}', "</tool_call>"])
    assert events[0].tool_calls is None
    (call,) = events[-1].tool_calls or []
    assert call["type"] == "function" and call["id"].startswith("call_") and "index" not in call
    assert call["function"] == {"name": "weather", "arguments": '{"a": 1}'}


def test_a_cut_answer_keeps_length_and_text_without_calls_stays_content() -> None:
    plan = plan_tools(_request(), "hermes")
    assert plan is not None
    cut = _events(plan, ['<tool_call>{"name": "clock", "arguments": {'], finish="length")
    assert cut[-1].finish_reason == "length"
    plain = _events(plan, ["no calls ", "here"])
    assert "".join(e.text for e in plain) == "no calls here" and plain[-1].finish_reason == "stop"


def test_required_and_named_are_constrained() -> None:
    required = plan_tools(_request("required"), None)
    assert required is not None and required.constraint is not None
    events = _events(required, ['[{"name": "clock", "parameters": {}}]'])
    assert events[-1].finish_reason == "tool_calls"
    named = plan_tools(_request({"type": "function", "function": {"name": "weather"}}), "mistral")
    assert named is not None and named.constraint == StructuredOutput(json_schema='{"type":"object"}')
    events = _events(named, ['{"a"', ": 2}"])
    assert events[-1].finish_reason == "stop"  # as OpenAI answers a named function
    deltas = [d for e in events for d in e.tool_calls or []]
    assert len(deltas[0]["id"]) == 9  # the family's ids: Mistral's templates take no other
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"a": 2}'


def test_the_constraint_joins_the_sampling_and_refuses_a_second_one() -> None:
    plan = plan_tools(_request("required"), "hermes")
    assert plan is not None
    assert plan.sampling(SamplingParams()).structured == plan.constraint
    with pytest.raises(InvalidInput, match="cannot be combined"):
        plan.sampling(SamplingParams(structured=StructuredOutput(json_object=True)))


def test_none_shows_no_tools_and_reads_no_calls() -> None:
    plan = plan_tools(_request("none"), "hermes")
    assert plan is not None and plan.render_tools is None and plan.output() is None
    assert plan_tools(GenerateRequest(request_id="r", prompt="x"), "hermes") is None


def test_auto_without_a_parser_is_refused_naming_the_option() -> None:
    with pytest.raises(InvalidInput, match="options.tool_parser"):
        plan_tools(_request("auto"), None)


def test_template_messages_carry_calls_with_arguments_as_objects() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": '{"tz": "UTC"}'}}
    messages = template_messages(
        [
            ChatMessage(role="assistant", content="", tool_calls=[call]),
            ChatMessage(role="tool", content="12:00", tool_call_id="call_1", name="clock"),
        ]
    )
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}
    assert json.loads(call["function"]["arguments"]) == {"tz": "UTC"}  # the request's own is untouched
    assert messages[1] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1", "name": "clock"}
