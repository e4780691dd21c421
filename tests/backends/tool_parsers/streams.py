"""Helpers of the tool parser tests: feed an output in random pieces and add the deltas up."""

from __future__ import annotations

import random
from typing import Any, Protocol

from backends.tool_parsers import StreamDelta


class _Streaming(Protocol):
    def feed(self, text: str) -> StreamDelta: ...
    def finish(self) -> StreamDelta: ...


def pieces(text: str, rng: random.Random) -> list[str]:
    """`text` cut at random places (pieces of 1 to 8 characters, some empty)."""
    out, at = [], 0
    while at < len(text):
        size = rng.choice([0, 1, 1, 2, 3, 5, 8])
        out.append(text[at : at + size])
        at += size
    return out


def stream(parser: _Streaming, chunks: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """Feed `chunks`, then finish; the content and the calls the deltas add up to (checking that
    each call's first delta carries its id, type and name, and later ones only argument text)."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for delta in [*(parser.feed(c) for c in chunks), parser.finish()]:
        content.append(delta.content)
        for d in delta.tool_calls:
            if d["index"] == len(calls):
                assert (d["id"].startswith("call_") or len(d["id"]) == 9) and d["type"] == "function", d
                assert d["function"]["arguments"] == "" and d["function"]["name"], d
                calls.append({"name": d["function"]["name"], "arguments": ""})
            else:
                assert d["index"] == len(calls) - 1 and set(d) == {"index", "function"}, d
                assert set(d["function"]) == {"arguments"}, d
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return "".join(content), calls
