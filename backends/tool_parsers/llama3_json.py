"""Llama 3.1 / 3.2 JSON tool calls (vLLM's `llama3_json`): the output is `{"name": ...,
"parameters": {...}}`, several separated by `;`, either from its start or after `<|python_tag|>`
(a special token, present only where the detokenizer keeps special tokens)."""

from __future__ import annotations

from backends.tool_parsers.framing import FramedToolParser


class Llama3JsonToolParser(FramedToolParser):
    """Calls as JSON objects opening the output; any other output is content."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    bare_start = "{"
    separator = ";"
    # Llama's template asks for "parameters"; models trained on other data write "arguments"
    args_keys = ("parameters", "arguments")
