"""Mistral tool calls (vLLM's `mistral`): `[TOOL_CALLS]` followed by a JSON array of
`{"name": ..., "arguments": {...}}`. `[TOOL_CALLS]` is a control token that a detokenizer skipping
special tokens drops, so an output that opens with the array is read as calls too. Call ids are
nine letters and digits, the only ones its templates take back."""

from __future__ import annotations

from backends.tool_parsers.calls import new_short_call_id
from backends.tool_parsers.framing import FramedToolParser


class MistralToolParser(FramedToolParser):
    """Calls in the array after `[TOOL_CALLS]` (or opening the output); the text before is content."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    bare_start = "["
    arrays = True
    new_id = staticmethod(new_short_call_id)
