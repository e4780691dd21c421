"""`tool_choice: "required"` and a named function, enforced by the engine's grammar.

Both become a JSON schema (`StructuredOutput.json_schema`) that constrained decoding keeps, so the
output always parses and its arguments validate against the function's `parameters`; the output is
then turned into calls directly, without a family parser:

- a named function: the output *is* its arguments object (schema: the function's `parameters`);
- `"required"`: the output is `[{"name": ..., "parameters": {...}}, ...]`, one `anyOf` branch per
  function (vLLM's approach), at least one call, at most one when `parallel_tool_calls` is false.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from backends.base import StructuredOutput
from backends.errors import InvalidInput
from backends.tool_parsers.calls import ParsedOutput, StreamDelta, ToolCall, new_call_id
from backends.tool_parsers.framing import FramedToolParser

#: the schema of a function that declares no `parameters`: an object with any members
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
#: keys under which a schema keeps definitions that `$ref`s point to from its root
_DEFINITIONS = ("$defs", "definitions")


def canonical_schema(schema: dict[str, Any]) -> str:
    """The schema as canonical JSON text (sorted keys, no spaces), the key compiled grammars are
    cached under."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = (tool.get("function") or {}).get("parameters")
    return params if isinstance(params, dict) and params else dict(_ANY_OBJECT)


def _function_name(tool: dict[str, Any]) -> str:
    return str((tool.get("function") or {}).get("name"))


def _refs(schema: Any) -> list[str]:
    """Every `$ref` in `schema`, at any depth."""
    if isinstance(schema, dict):
        own = [schema["$ref"]] if isinstance(schema.get("$ref"), str) else []
        return own + [r for value in schema.values() for r in _refs(value)]
    if isinstance(schema, list):
        return [r for value in schema for r in _refs(value)]
    return []


def _check_refs(tool: dict[str, Any], params: dict[str, Any]) -> None:
    """Under "required" a function's `parameters` are no longer the root: a `$ref` to the root
    (`#`) or into it (`#/properties/...`) would point elsewhere; those to definitions move along."""
    for ref in _refs(params):
        if ref.startswith("#") and not ref.startswith(tuple(f"#/{key}/" for key in _DEFINITIONS)):
            raise InvalidInput(
                f"`tools`: the parameters of {_function_name(tool)!r} use `$ref: {ref}`, which "
                "`tool_choice: required` cannot keep; point references into `$defs`"
            )


def named_function_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """The schema of the output when `tool_choice` names `tool`: its arguments object."""
    return _parameters(tool)


def required_schema(tools: list[dict[str, Any]], parallel_tool_calls: bool) -> dict[str, Any]:
    """The schema of the output under `tool_choice: "required"`: an array of calls.

    Definitions (`$defs`) of the functions move to the root, where their `$ref`s point.

    Raises:
        InvalidInput: two functions define one name differently.
    """
    branches: list[dict[str, Any]] = []
    defs: dict[str, dict[str, Any]] = {key: {} for key in _DEFINITIONS}
    for tool in tools:
        params = dict(_parameters(tool))
        _check_refs(tool, params)
        for key in _DEFINITIONS:
            for name, definition in (params.pop(key, None) or {}).items():
                if defs[key].setdefault(name, definition) != definition:
                    raise InvalidInput(f"`tools` define `{key}.{name}` in two different ways")
        branches.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [_function_name(tool)]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update({key: found for key, found in defs.items() if found})
    return schema


def chosen_tool(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """The tool a `{"type": "function", "function": {"name": ...}}` choice names, else None."""
    if not isinstance(tool_choice, dict):
        return None
    wanted = (tool_choice.get("function") or {}).get("name")
    return next((t for t in tools if _function_name(t) == wanted), None)


def tool_choice_constraint(
    tools: list[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, parallel_tool_calls: bool
) -> StructuredOutput | None:
    """The grammar constraint a tool choice needs: for a named function or `"required"`, else None
    (`"auto"` and `"none"` leave the output free)."""
    if not tools:
        return None
    tool = chosen_tool(tools, tool_choice)
    if tool is not None:
        return StructuredOutput(json_schema=canonical_schema(named_function_schema(tool)))
    if tool_choice == "required":
        return StructuredOutput(json_schema=canonical_schema(required_schema(tools, parallel_tool_calls)))
    return None


class RequiredToolParser(FramedToolParser):
    """Reads the output of `tool_choice: "required"`: `[{"name": ..., "parameters": {...}}, ...]`.

    The grammar leaves no room for content: text outside the calls can only be the start of a call
    that `max_tokens` cut before it was named, which is no message for the user, so none is passed.
    """

    name = "required"
    bare_start = "["
    arrays = True
    args_keys = ("parameters",)

    def _emit(self, text: str) -> None:
        pass


class NamedToolParser:
    """Reads the output of a named function choice: all of it is the call's arguments.

    Args:
        function: the function's name.
        new_id: makes the call's id.
    """

    def __init__(self, function: str, new_id: Callable[[], str] = new_call_id) -> None:
        self._call = ToolCall(id=new_id(), name=function)
        self._started = False
        self.calls = [self._call]

    @classmethod
    def parse(cls, text: str, function: str) -> ParsedOutput:
        """A whole output as the one call it is."""
        parser = cls(function)
        parser.feed(text)
        return ParsedOutput(content="", calls=parser.calls)

    def feed(self, text: str) -> StreamDelta:
        """The call's first delta (once), then `text` as argument text."""
        out = StreamDelta()
        if not self._started:
            self._started = True
            header = {"name": self._call.name, "arguments": ""}
            out.tool_calls.append({"index": 0, "id": self._call.id, "type": "function", "function": header})
        if text:
            self._call.arguments += text
            out.tool_calls.append({"index": 0, "function": {"arguments": text}})
        return out

    def finish(self) -> StreamDelta:
        return self.feed("")


def choice_parser(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None, new_id: Callable[[], str] = new_call_id
) -> RequiredToolParser | NamedToolParser | None:
    """The parser of a constrained tool choice's output (None for `"auto"` / `"none"`); `new_id`
    makes call ids the deployment's chat template takes back."""
    tool = chosen_tool(tools, tool_choice)
    if tool is not None:
        return NamedToolParser(_function_name(tool), new_id)
    if tool_choice == "required":
        return RequiredToolParser({_function_name(t) for t in tools}, new_id)
    return None
