"""The family parsers (hermes, llama3_json, mistral): whole outputs, the same outputs streamed in
random pieces, parallel calls, and malformed call text handed on as content."""

from __future__ import annotations

import json
import random

import pytest

from backends.tool_parsers import PARSERS, FramedToolParser, default_parser, parser_class
from backends.tool_parsers.hermes import HermesToolParser
from backends.tool_parsers.llama3_json import Llama3JsonToolParser
from backends.tool_parsers.mistral import MistralToolParser
from tests.backends.tool_parsers.streams import pieces, stream

WEATHER = '{"city": "Paris", "days": [1, 2.5e1, -3], "units": "c\\u00b0\\"", "ok": true, "x": null}'

#: (parser, output, content, [(name, arguments)])
CASES = [
    (HermesToolParser, "Just text, no <tool call> here.", "Just text, no <tool call> here.", []),
    (
        HermesToolParser,
        f'Let me look.\n<tool_call>\n{{"name": "weather", "arguments": {WEATHER}}}\n</tool_call>',
        "Let me look.",
        [("weather", WEATHER)],
    ),
    (  # parallel calls, arguments before the name, a function without arguments
        HermesToolParser,
        '<tool_call>\n{"arguments": {"a": {"b": [1, {}]}}, "name": "f"}\n</tool_call>\n'
        '<tool_call>\n{"name": "g"}\n</tool_call>\n',
        "",
        [("f", '{"a": {"b": [1, {}]}}'), ("g", "{}")],
    ),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.', "Done.", [("f", "{}")]),
    (
        Llama3JsonToolParser,
        f' {{"name": "weather", "parameters": {WEATHER}}}',
        "",
        [("weather", WEATHER)],
    ),
    (
        Llama3JsonToolParser,
        '<|python_tag|>{"name": "f", "parameters": {"q": 1}}; {"name": "g", "arguments": {"r": "s"}}',
        "",
        [("f", '{"q": 1}'), ("g", '{"r": "s"}')],
    ),
    (Llama3JsonToolParser, "Paris is in France {not a call}", "Paris is in France {not a call}", []),
    (
        MistralToolParser,
        f'[TOOL_CALLS] [{{"name": "weather", "arguments": {WEATHER}}}, {{"name": "g", "arguments": {{}}}}]',
        "",
        [("weather", WEATHER), ("g", "{}")],
    ),
    (  # the control token skipped by the detokenizer: the output opens with the array
        MistralToolParser,
        '[{"name": "f", "arguments": {"a": "[TOOL_CALLS]"}}]',
        "",
        [("f", '{"a": "[TOOL_CALLS]"}')],
    ),
    (MistralToolParser, "Sure [TOOL_CALLS][{\"name\": \"f\", \"arguments\": {}}]", "Sure", [("f", "{}")]),
    (MistralToolParser, "[1] is a footnote", "[1] is a footnote", []),
]

#: outputs whose call text is broken before the call could stand: all of it is content
MALFORMED = [
    (HermesToolParser, 'a <tool_call>{"name": 3, "arguments": {}}</tool_call> b'),
    (HermesToolParser, "<tool_call>not json</tool_call>"),
    (HermesToolParser, '<tool_call>{"arguments": {"a": 1}}</tool_call>'),
    (HermesToolParser, '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>'),
    (HermesToolParser, '<tool_call>{"name": "f", "argu'),
    (HermesToolParser, "<tool_call>"),
    (HermesToolParser, "<tool_ca"),
    (Llama3JsonToolParser, '{"parameters": {"a": 1}, "other": 2}'),
    (Llama3JsonToolParser, '{"name": "f",, "parameters": {}}'),
    (MistralToolParser, "[TOOL_CALLS] nothing"),
    (MistralToolParser, '[TOOL_CALLS] [{"name": null}]'),
]


def _whole(parser: type[FramedToolParser], text: str) -> tuple[str, list[tuple[str, str]]]:
    parsed = parser.parse(text)
    assert all(c.id.startswith("call_") or (parser.name == "mistral" and len(c.id) == 9) for c in parsed.calls)
    return parsed.content, [(c.name, c.arguments) for c in parsed.calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_whole_output(parser: type[FramedToolParser], text: str, content: str, calls: list) -> None:
    assert _whole(parser, text) == (content, calls)
    for _, arguments in calls:
        assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_streamed_in_any_pieces_adds_up_to_the_whole(
    parser: type[FramedToolParser], text: str, content: str, calls: list
) -> None:
    rng = random.Random(text)
    for chunks in [[text], list(text), *(pieces(text, rng) for _ in range(40))]:
        got_content, got_calls = stream(parser(), chunks)
        assert (got_content, [(c["name"], c["arguments"]) for c in got_calls]) == (content, calls), chunks


@pytest.mark.parametrize(("parser", "text"), MALFORMED)
def test_malformed_call_text_is_content(parser: type[FramedToolParser], text: str) -> None:
    assert _whole(parser, text) == (text, [])
    rng = random.Random(text)
    for chunks in [list(text), *(pieces(text, rng) for _ in range(20))]:
        assert stream(parser(), chunks) == (text, [])


def test_a_call_broken_after_it_began_keeps_its_arguments_so_far() -> None:
    """Once named and under way a call stands (as a call cut by max_tokens does); the text from
    the character that broke it is content."""
    text = '<tool_call>{"name": "f", "arguments": {"a": 1,,}}</tool_call>'
    assert _whole(HermesToolParser, text) == (',}}</tool_call>', [("f", '{"a": 1,')])
    assert _whole(HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": [1') == ("", [("f", '{"a": [1')])


def test_names_outside_the_request_are_not_calls() -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    parsed = HermesToolParser.parse(text, tool_names={"weather"})
    assert (parsed.content, parsed.calls) == (text, [])


@pytest.mark.parametrize("parser", list(PARSERS.values()))
def test_random_fragments_never_crash_and_stream_like_the_whole(parser: type[FramedToolParser]) -> None:
    fragments = [
        "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "[", "]", "{", "}", ",", ";",
        '"name"', '"arguments"', '"parameters"', ":", '"f"', " ", "\n", "1", "tru", "e", "\\", '"', "x",
        '{"name": "f", "arguments": {"a": [1, "b"]}}', '"a\\u00e9"',
    ]  # fmt: skip
    rng = random.Random(parser.name)
    for _ in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 14)))
        whole = parser.parse(text)
        content, calls = stream(parser(), pieces(text, rng))
        assert content == whole.content, text
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole.calls], text
        if not whole.calls:
            assert whole.content == text


def test_parsers_by_name_and_by_template() -> None:
    assert parser_class("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="unknown tool_parser 'qwen': use one of hermes, llama3_json, mistral"):
        parser_class("qwen")
    assert default_parser("{% for tool in tools %}<tool_call>{{ tool | tojson }}{% endfor %}") == "hermes"
    assert default_parser("[AVAILABLE_TOOLS] ... [TOOL_CALLS] ...") == "mistral"
    assert default_parser("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert default_parser("{{ messages }}") is None
    assert default_parser(None) is None
