"""Tool call parsers shared by the own engines (torch_llm, later an OpenVINO LLM backend).

One module per model family, under vLLM's names, each a whole-text parser (`parse`) and a
streaming one (`feed` / `finish`) that turns text deltas into content and OpenAI `tool_calls`
deltas. `choice` builds the grammar constraints of `tool_choice: "required"` and of a named
function, and reads their outputs.
"""

from __future__ import annotations

from backends.tool_parsers.calls import ParsedOutput, StreamDelta, ToolCall
from backends.tool_parsers.framing import FramedToolParser
from backends.tool_parsers.hermes import HermesToolParser
from backends.tool_parsers.llama3_json import Llama3JsonToolParser
from backends.tool_parsers.mistral import MistralToolParser

#: `options.tool_parser` names (vLLM's) -> parser
PARSERS: dict[str, type[FramedToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

#: what a chat template writes or mentions that tells its family, checked in this order
_TEMPLATE_SIGNS: tuple[tuple[str, str], ...] = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_tag|>", "llama3_json"),
    ('{"name": function name, "parameters"', "llama3_json"),
)


def parser_class(name: str) -> type[FramedToolParser]:
    """The parser named `name`.

    Raises:
        ValueError: no parser has that name (the message lists those that do).
    """
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool_parser {name!r}: use one of {', '.join(sorted(PARSERS))}") from None


def default_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool format asks for, or None when it is not recognised."""
    for sign, name in _TEMPLATE_SIGNS:
        if chat_template and sign in chat_template:
            return name
    return None


__all__ = [
    "PARSERS",
    "FramedToolParser",
    "ParsedOutput",
    "StreamDelta",
    "ToolCall",
    "default_parser",
    "parser_class",
]
