"""Hermes / Qwen2.5 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks,
one call each, anywhere in the output (vLLM's `hermes`)."""

from __future__ import annotations

from backends.tool_parsers.framing import FramedToolParser


class HermesToolParser(FramedToolParser):
    """Calls in `<tool_call>` blocks; the text around them is content."""

    name = "hermes"
    markers = ("<tool_call>",)
    end_tag = "</tool_call>"
