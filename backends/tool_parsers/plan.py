"""What a request's tools ask of an own engine: the prompt, the constraint and the output's reading.

An engine calls `plan_tools` once per request, renders the prompt with `template_messages` and
`ToolPlan.render_tools` through the model's own chat template, adds `ToolPlan.constraint` to its
sampling, and passes every event through `ToolPlan.output()`, which turns the text into content and
`tool_calls` (deltas in a stream, whole calls on the last event of a whole answer).

OpenAI's semantics: `"none"` shows the model no tools and reads no calls; `"auto"` (the default
with tools) reads calls with the deployment's family parser; `"required"` and a named function are
forced by the grammar. A whole answer that made calls ends with `finish_reason: "tool_calls"`, a
named function with `"stop"`, as OpenAI answers; an answer cut by `max_tokens` keeps `"length"`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

from backends.base import ChatMessage, GenerateRequest, SamplingParams, StructuredOutput, TokenEvent
from backends.errors import InvalidInput
from backends.tool_parsers import PARSERS
from backends.tool_parsers.calls import StreamDelta, ToolCall, new_call_id
from backends.tool_parsers.choice import NamedToolParser, choice_parser, tool_choice_constraint
from backends.tool_parsers.framing import FramedToolParser

_Parser = FramedToolParser | NamedToolParser

#: OpenAI request fields (`GenerateRequest.extra`, forwarded as sent to remote upstreams) that an
#: engine following this plan honours
TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})


class ToolPlan(msgspec.Struct, kw_only=True):
    """How one request's tools are served."""

    #: the tools handed to the chat template (None: the model is shown none)
    render_tools: list[dict[str, Any]] | None
    #: the grammar constraint of "required" / a named function (None: the output is free)
    constraint: StructuredOutput | None
    #: makes the parser that reads the output (None: the output is content only)
    parser: Callable[[], _Parser] | None
    #: the finish reason of an answer that ended by itself after making calls
    finish_with_calls: str
    #: the caller reads a stream: calls go out as deltas (else whole, on the last event)
    stream: bool

    def sampling(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` with the constraint of the tool choice.

        Raises:
            InvalidInput: the request also constrains its output otherwise (`response_format`...).
        """
        if self.constraint is None:
            return sampling
        if sampling.structured is not None:
            raise InvalidInput("`tool_choice` 'required' or a named function cannot be combined with another "
                               "output constraint (`response_format`, `structured_outputs`); leave one out")
        return msgspec.structs.replace(sampling, structured=self.constraint)

    def constrained(self, request: GenerateRequest) -> GenerateRequest:
        """`request` with the constraint of the tool choice in its sampling (see `sampling`)."""
        sampling = self.sampling(request.sampling)
        return request if sampling is request.sampling else msgspec.structs.replace(request, sampling=sampling)

    def output(self) -> ToolCallOutput | None:
        """A reader of one generation's events (None when no calls are read)."""
        return ToolCallOutput(self.parser(), self.finish_with_calls, self.stream) if self.parser else None


def shown_tools(request: GenerateRequest) -> list[dict[str, Any]] | None:
    """The tools the chat template renders for `request` (none under `tool_choice: "none"`)."""
    return request.tools if request.tools and request.tool_choice != "none" else None


def plan_tools(request: GenerateRequest, parser_name: str | None) -> ToolPlan | None:
    """The plan of `request`'s tools on a deployment whose family parser is `parser_name`.

    Raises:
        InvalidInput: `"auto"` on a deployment without a tool parser.
    """
    if not request.tools:
        return None
    family = PARSERS.get(parser_name) if parser_name else None
    new_id = family.new_id if family else new_call_id
    choice = request.tool_choice or "auto"
    if choice == "none":
        return ToolPlan(render_tools=None, constraint=None, parser=None, finish_with_calls="stop", stream=request.stream)
    constraint = tool_choice_constraint(request.tools, choice, request.parallel_tool_calls)
    if constraint is not None:
        tools = request.tools

        def parser() -> _Parser:
            made = choice_parser(tools, choice, new_id)
            assert made is not None  # a constraint means a constrained choice
            return made

        finish = "stop" if isinstance(choice, dict) else "tool_calls"
        return ToolPlan(render_tools=tools, constraint=constraint, parser=parser, finish_with_calls=finish,
                        stream=request.stream)  # fmt: skip
    if family is None:
        raise InvalidInput(
            "`tool_choice` 'auto' needs a tool parser, and this deployment's chat template is not one "
            f"fleetgate recognises: set its `options.tool_parser` ({', '.join(sorted(PARSERS))}), or "
            "send `tool_choice` 'required' or a named function"
        )
    names = {str((t.get("function") or {}).get("name")) for t in request.tools}
    return ToolPlan(
        render_tools=request.tools,
        constraint=None,
        parser=lambda: family(names),
        finish_with_calls="tool_calls",
        stream=request.stream,
    )


class ToolCallOutput:
    """Reads one generation's events: text becomes content and tool calls."""

    def __init__(self, parser: _Parser, finish_with_calls: str, stream: bool) -> None:
        self._parser = parser
        self._finish_with_calls = finish_with_calls
        self._stream = stream

    def rewrite(self, event: TokenEvent) -> TokenEvent:
        """`event` with its text read: content in `text`, calls in `tool_calls`."""
        delta = self._parser.feed(event.text)
        finish = event.finish_reason
        if finish is not None:
            rest = self._parser.finish()
            delta = StreamDelta(content=delta.content + rest.content, tool_calls=delta.tool_calls + rest.tool_calls)
        calls: list[ToolCall] = self._parser.calls
        if self._stream:
            tool_calls = delta.tool_calls or None
        else:  # a whole answer: the calls, whole, once the text has ended
            tool_calls = [c.to_openai() for c in calls] if finish is not None and calls else None
        if finish == "stop" and calls:
            finish = self._finish_with_calls
        return msgspec.structs.replace(event, text=delta.content, tool_calls=tool_calls, finish_reason=finish)


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's call as chat templates read it: arguments as an object (OpenAI sends
    them as JSON text; templates write them with `tojson`)."""
    function = dict(call.get("function") or {})
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except ValueError:
            pass  # not JSON: the template gets the text as sent
    return {**call, "function": function}


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """A chat as chat templates read it, with assistant calls, tool results' ids and names."""
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out
