"""A small OpenAI-compatible upstream for the remote backend's tests: another server of the fleet.

It "generates" deterministically: the completion is the prompt's words in reverse order, one word per
stream event, truncated at `max_tokens` words. That makes every answer predictable, so the tests can
check exactly what passed through the gateway. a prompt containing "fail-midway" breaks the stream after
two words; `model == "missing"` answers 404 like a real server; `model == "busy-for-seed-1"` answers 503 to a
request with `seed: 1` (the second choice of a seeded `n` request); a prompt containing `sleep-ms-N`
answers N milliseconds late (a slow upstream, for tests that must catch a job half-way). A chat that
offers `tools` (and a `tool_choice` other than "none") is answered with one call of the chosen (or
first) tool, whose arguments are `{"words": [...]}`, the reply words; streamed, the arguments come in
two pieces.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, post
from litestar.response import Stream

_enc = msgspec.json.Encoder()


def reply_words(prompt: str, max_tokens: int) -> list[str]:
    words = prompt.split()[::-1] or ["empty"]
    return words[:max_tokens]


def _prompt_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        return " ".join(m.get("content") or "" for m in body["messages"])
    p = body.get("prompt", "")
    return p if isinstance(p, str) else " ".join(str(x) for x in p)


async def _events(body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
    prompt = _prompt_of(body)
    words = reply_words(prompt, int(body.get("max_tokens") or 16))
    for i, word in enumerate(words):
        if "fail-midway" in prompt and i == 2:
            raise RuntimeError("upstream broke")
        text = word if i == 0 else " " + word
        if chat:
            choice = {"index": 0, "delta": {"content": text}, "finish_reason": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": None}
        yield (
            b"data: "
            + _enc.encode(
                {"id": "u", "object": "chunk", "created": 0, "model": body["model"], "choices": [choice]}
            )
            + b"\n\n"
        )
        await asyncio.sleep(0.001)
    finish = "length" if len(words) == int(body.get("max_tokens") or 16) else "stop"
    last = (
        {"index": 0, "delta": {}, "finish_reason": finish}
        if chat
        else {"index": 0, "text": "", "finish_reason": finish}
    )
    yield (
        b"data: "
        + _enc.encode({"id": "u", "object": "chunk", "created": 0, "model": body["model"], "choices": [last]})
        + b"\n\n"
    )
    usage = _usage(prompt, words)
    yield (
        b"data: "
        + _enc.encode(
            {
                "id": "u",
                "object": "chunk",
                "created": 0,
                "model": body["model"],
                "choices": [],
                "usage": usage,
            }
        )
        + b"\n\n"
    )
    yield b"data: [DONE]\n\n"


def _tool_call(body: dict[str, Any]) -> tuple[str, str] | None:
    """(tool name, JSON arguments) when this chat asks for a tool call, else None."""
    choice = body.get("tool_choice", "auto")
    if not body.get("tools") or choice == "none":
        return None
    name = choice["function"]["name"] if isinstance(choice, dict) else body["tools"][0]["function"]["name"]
    words = reply_words(_prompt_of(body), int(body.get("max_tokens") or 16))
    return name, _enc.encode({"words": words}).decode()


async def _tool_events(body: dict[str, Any], name: str, arguments: str) -> AsyncIterator[bytes]:
    half = len(arguments) // 2
    call: dict[str, Any] = {"index": 0, "id": "call_0", "type": "function", "function": {"name": name, "arguments": ""}}
    if body.get("model") == "malformed-tools":  # failure injection: a broken upstream
        call["function"] = ["not", "an", "object"]
    deltas = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"tool_calls": [{"index": 0, "function": {"arguments": arguments[:half]}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": arguments[half:]}}]},
    ]
    for delta in deltas:
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        yield b"data: " + _enc.encode({"id": "u", "object": "chunk", "model": body["model"], "choices": [choice]}) + b"\n\n"
    last = {"index": 0, "delta": {}, "finish_reason": "tool_calls"}
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    yield b"data: " + _enc.encode({"id": "u", "object": "chunk", "model": body["model"], "choices": [last]}) + b"\n\n"
    yield b"data: " + _enc.encode({"id": "u", "object": "chunk", "model": body["model"], "choices": [], "usage": usage}) + b"\n\n"
    yield b"data: [DONE]\n\n"


#: the last request bodies this upstream received (newest last), for tests of what is forwarded
RECEIVED: list[dict[str, Any]] = []
RECEIVED_HEADERS: list[dict[str, str]] = []


_SLEEP = re.compile(r"sleep-ms-([0-9]+)")
_CACHED = re.compile(r"cached-(\d+)")


def _usage(prompt: str, words: list[str]) -> dict[str, Any]:
    """A word a token; a prompt saying `cached-N` reports N of its tokens served from a prompt cache."""
    usage: dict[str, Any] = {
        "prompt_tokens": len(prompt.split()),
        "completion_tokens": len(words),
        "total_tokens": len(prompt.split()) + len(words),
    }
    cached = _CACHED.search(prompt)
    if cached:
        usage["prompt_tokens_details"] = {"cached_tokens": int(cached.group(1))}
    if "malformed-usage" in prompt:  # failure injection: a broken upstream
        usage["prompt_tokens_details"] = {"cached_tokens": "lots"}
    if "negative-usage" in prompt:
        usage["prompt_tokens"] = -1
    return usage


#: failure injection: a prompt with `slow-once-<token>` is answered 2 s late the first time only
_SLOW_ONCE = re.compile(r"slow-once-([a-z0-9]+)")
_SLOWED: set[str] = set()


async def _handle(request: Request, chat: bool) -> Response[Any]:
    body = msgspec.json.decode(await request.body())
    slow = _SLEEP.search(_prompt_of(body))
    if slow:
        await asyncio.sleep(int(slow.group(1)) / 1000)
    once = _SLOW_ONCE.search(_prompt_of(body))
    if once and once.group(1) not in _SLOWED:
        _SLOWED.add(once.group(1))
        await asyncio.sleep(2.0)
    RECEIVED.append(body)
    del RECEIVED[:-50]
    RECEIVED_HEADERS.append(dict(request.headers))
    del RECEIVED_HEADERS[:-50]
    if body.get("model") == "missing":
        return Response(
            {"error": {"message": "model missing not found", "type": "not_found"}}, status_code=404
        )
    if body.get("model") == "busy-for-seed-1" and body.get("seed") == 1:  # failure injection: one choice of n
        return Response({"error": {"message": "overloaded"}}, status_code=503)
    if request.headers.get("authorization") != "Bearer upstream-secret":
        return Response({"error": {"message": "bad upstream key"}}, status_code=401)
    tool = _tool_call(body) if chat else None
    if tool is not None and body.get("stream"):
        return Stream(_tool_events(body, *tool), media_type="text/event-stream")
    if tool is not None:
        call = {"id": "call_0", "type": "function", "function": {"name": tool[0], "arguments": tool[1]}}
        if body.get("model") == "malformed-tools":  # failure injection: a broken upstream
            call["function"] = ["not", "an", "object"]
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        return Response({"choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}], "usage": usage})
    if not body.get("stream"):  # a whole answer, shaped as OpenAI servers shape it
        prompt = _prompt_of(body)
        max_tokens = int(body.get("max_tokens") or 16)
        words = reply_words(prompt, max_tokens)
        text = " ".join(words)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if len(words) == max_tokens else "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        usage = _usage(prompt, words)
        return Response({"choices": [choice], "created": int(time.time()), "usage": usage})
    return Stream(_events(body, chat), media_type="text/event-stream")


@post("/v1/completions", status_code=200)
async def completions(request: Request) -> Response[Any]:
    return await _handle(request, chat=False)


@post("/v1/chat/completions", status_code=200)
async def chat(request: Request) -> Response[Any]:
    return await _handle(request, chat=True)


def create_upstream() -> Litestar:
    return Litestar([completions, chat], openapi_config=None)
