"""tool_choice "required" and a named function: the schemas the grammar enforces, and the parsers
that turn the constrained output into calls."""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import pytest

from backends.errors import InvalidInput
from backends.tool_parsers.choice import (
    NamedToolParser,
    RequiredToolParser,
    choice_parser,
    required_schema,
    tool_choice_constraint,
)
from tests.backends.tool_parsers.streams import pieces, stream


def _tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = _tool(
    "weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
        "required": ["city"],
        "$defs": {"unit": {"enum": ["c", "f"]}},
    },
)
CLOCK = _tool("clock")
TOOLS = [WEATHER, CLOCK]


def _schema(choice: Any, parallel: bool = True) -> dict[str, Any]:
    constraint = tool_choice_constraint(TOOLS, choice, parallel)
    assert constraint is not None and constraint.json_schema is not None
    # canonical: sorted keys, so equal schemas share one compiled grammar
    assert constraint.json_schema == json.dumps(json.loads(constraint.json_schema), sort_keys=True, separators=(",", ":"))
    return json.loads(constraint.json_schema)


def test_a_named_function_constrains_the_output_to_its_arguments() -> None:
    schema = _schema({"type": "function", "function": {"name": "weather"}})
    assert schema == WEATHER["function"]["parameters"]
    jsonschema.validate({"city": "Paris", "unit": "c"}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "k"}, schema)
    # a function without parameters takes any object
    assert _schema({"type": "function", "function": {"name": "clock"}}) == {"type": "object"}


def test_required_is_an_array_of_calls_with_definitions_at_the_root() -> None:
    schema = _schema("required")
    assert schema["$defs"] == {"unit": {"enum": ["c", "f"]}} and schema["minItems"] == 1
    good = [{"name": "weather", "parameters": {"city": "Oslo", "unit": "f"}}, {"name": "clock", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "weather", "parameters": {"unit": "c"}}],
        [{"name": "weather", "parameters": {"city": "x", "unit": "k"}}],
        [{"name": "clock", "parameters": {}, "extra": 1}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = _schema("required", parallel=False)
    assert single["maxItems"] == 1
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)


def test_auto_and_none_leave_the_output_free() -> None:
    assert tool_choice_constraint(TOOLS, "auto", True) is None
    assert tool_choice_constraint(TOOLS, "none", True) is None
    assert tool_choice_constraint(TOOLS, None, True) is None
    assert tool_choice_constraint(None, "required", True) is None


def test_conflicting_definitions_are_refused() -> None:
    other = _tool("other", {"type": "object", "$defs": {"unit": {"enum": ["k"]}}})
    with pytest.raises(InvalidInput, match=r"\$defs.unit"):
        required_schema([WEATHER, other], True)


def test_references_to_the_root_are_refused_under_required() -> None:
    """The function's parameters are not the root of the required schema: `#` would be the array."""
    tree = _tool("tree", {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}})
    with pytest.raises(InvalidInput, match="'tree' use `\\$ref: #`"):
        required_schema([tree], True)
    assert _schema({"type": "function", "function": {"name": "weather"}})  # named: the root, refs hold
    legacy = _tool("legacy", {"type": "object", "properties": {"u": {"$ref": "#/definitions/u"}},
                              "definitions": {"u": {"enum": [1]}}})  # fmt: skip
    assert required_schema([legacy], True)["definitions"] == {"u": {"enum": [1]}}


def test_the_required_output_streams_as_calls() -> None:
    text = '[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "clock", "parameters": {}}]'
    expected = [{"name": "weather", "arguments": '{"city": "Oslo"}'}, {"name": "clock", "arguments": "{}"}]
    parsed = RequiredToolParser.parse(text)
    assert (parsed.content, [(c.name, c.arguments) for c in parsed.calls]) == ("", [(e["name"], e["arguments"]) for e in expected])
    rng = random.Random(0)
    for _ in range(30):
        assert stream(RequiredToolParser(), pieces(text, rng)) == ("", expected)


def test_a_required_output_cut_by_max_tokens_has_no_content() -> None:
    """A call cut after it was named keeps its arguments so far; one cut before is not content."""
    parsed = RequiredToolParser.parse('[{"name": "clock", "parameters": {"zone": "U')
    assert (parsed.content, [(c.name, c.arguments) for c in parsed.calls]) == ("", [("clock", '{"zone": "U')])
    text = '[{"name": "clock", "parameters": {}}, {"name": "wea'
    parsed = RequiredToolParser.parse(text)
    assert (parsed.content, [(c.name, c.arguments) for c in parsed.calls]) == ("", [("clock", "{}")])
    assert stream(RequiredToolParser(), pieces(text, random.Random(1))) == ("", [{"name": "clock", "arguments": "{}"}])


def test_the_named_output_is_the_arguments() -> None:
    text = '{"city": "Oslo", "unit": "c"}'
    parsed = NamedToolParser.parse(text, "weather")
    assert (parsed.content, [(c.name, c.arguments) for c in parsed.calls]) == ("", [("weather", text)])
    rng = random.Random(0)
    for _ in range(10):
        assert stream(NamedToolParser("weather"), pieces(text, rng)) == ("", [{"name": "weather", "arguments": text}])
    # nothing generated: the call still has its first delta
    assert stream(NamedToolParser("weather"), []) == ("", [{"name": "weather", "arguments": ""}])


def test_choice_parser_picks_by_choice() -> None:
    assert isinstance(choice_parser(TOOLS, {"type": "function", "function": {"name": "clock"}}), NamedToolParser)
    assert isinstance(choice_parser(TOOLS, "required"), RequiredToolParser)
    assert choice_parser(TOOLS, "auto") is None
