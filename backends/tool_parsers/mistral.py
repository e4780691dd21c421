"""Mistral tool calls (vLLM's `mistral`): `[TOOL_CALLS]` followed by a JSON array of
`{"name": ..., "arguments": {...}}`. `[TOOL_CALLS]` is a control token that a detokenizer skipping
special tokens drops, so an output that opens with the array is read as calls too."""

from __future__ import annotations

from backends.tool_parsers.framing import FramedToolParser


class MistralToolParser(FramedToolParser):
    """Calls in the array after `[TOOL_CALLS]` (or opening the output); the text before is content."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    bare_start = "["
    arrays = True
