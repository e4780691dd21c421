"""The OpenAI side of the remote backend: request bodies, whole answers and server-sent events.

Pure translation between the internal generation types and OpenAI's JSON; the HTTP exchange is the
backend's. What no OpenAI server could accept is refused here (400) before anything is sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from backends.base import ChatMessage, GenerateRequest, TokenEvent, TokenLogprob, Usage
from backends.errors import BackendUnavailable, InvalidInput
from backends.openai_logprobs import read_logprobs
from backends.remote.client import UpstreamTooLong, UpstreamUnreachable
from backends.remote.errors import UpstreamMalformed, upstream_error
from backends.runtime.json_errors import JSON_DECODE_ERRORS

_json_decode = msgspec.json.Decoder()
_json_encode = msgspec.json.Encoder()

#: after [DONE], how long the rest of the answer may take to end before its connection is dropped
DRAIN_S = 1.0


def request_body(request: GenerateRequest, upstream_model: str) -> tuple[str, dict[str, Any]]:
    """The upstream call (path, JSON body) for `request`."""
    given = [x for x in (request.prompt, request.prompt_token_ids, request.messages) if x is not None]
    if len(given) != 1:
        raise InvalidInput("give exactly one of prompt, prompt_token_ids or messages")
    s = request.sampling
    if s.max_tokens < 1:
        raise InvalidInput(f"max_tokens must be >= 1, got {s.max_tokens}")
    body: dict[str, Any] = {
        "model": request.upstream_model or upstream_model,
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "stream": request.stream,
    }
    body.update(request.extra)  # fields the upstream honours and the gateway does not read
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    if s.seed is not None:
        body["seed"] = s.seed
    if s.stop:
        body["stop"] = s.stop
    if request.messages is not None:
        body["messages"] = [_message_json(m) for m in request.messages]
        if s.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = s.top_logprobs
        return "/v1/chat/completions", body
    if s.logprobs:
        body["logprobs"] = s.top_logprobs  # the completions API's one field: alternatives per token
    body["prompt"] = request.prompt if request.prompt is not None else request.prompt_token_ids
    return "/v1/completions", body


def whole_answer(name: str, request_id: str, raw: bytes) -> TokenEvent:
    """The one event of a non-streamed OpenAI answer: its text, finish reason and usage."""
    try:
        payload = _json_decode.decode(raw)
        choice = (payload.get("choices") or [{}])[0]
        text = choice.get("text")
        message = choice.get("message") or {}
        if text is None:
            text = message.get("content") or ""
        tool_calls = _tool_calls(message.get("tool_calls"))
        usage = _usage(payload.get("usage") or {})
        logprobs = read_logprobs(choice.get("logprobs"))
    except (*JSON_DECODE_ERRORS, AttributeError, TypeError, ValueError, IndexError, KeyError):
        raise UpstreamMalformed(f"upstream {name!r} sent a malformed completion") from None
    finish = choice.get("finish_reason") or "stop"
    return TokenEvent(
        request_id=request_id, text=str(text), finish_reason=finish, usage=usage,
        token_logprobs=logprobs, tool_calls=tool_calls,
    )  # fmt: skip


def _usage(u: dict[str, Any]) -> Usage:
    """An OpenAI `usage` object, with the prompt tokens served from the upstream's prompt cache
    (`prompt_tokens_details.cached_tokens`, where it says)."""
    prompt, completion = int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0))
    if prompt < 0 or completion < 0:
        raise ValueError("negative token counts")
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=max(0, min(cached, prompt)))


def _stream_usage(name: str, u: Any) -> Usage:
    try:
        return _usage(u)
    except (AttributeError, TypeError, ValueError):
        raise UpstreamMalformed(f"upstream {name!r} sent a malformed usage") from None


async def parse_sse(name: str, request_id: str, lines: AsyncIterator[str]) -> AsyncIterator[TokenEvent]:
    """The events of an OpenAI stream, one per chunk with text, logprobs or tool calls, then the last
    event with the finish reason and usage. A stream that ends before finishing is a 503."""
    finish: str | None = None
    usage: Usage | None = None
    done = False
    async for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            break
        try:
            chunk = _json_decode.decode(data)
        except JSON_DECODE_ERRORS:
            raise UpstreamMalformed(f"upstream {name!r} sent a malformed stream event") from None
        if chunk.get("error"):
            raise upstream_error(502, _json_encode.encode(chunk))
        if chunk.get("usage"):
            usage = _stream_usage(name, chunk["usage"])
        for choice in chunk.get("choices") or []:
            text = choice.get("text")
            delta = choice.get("delta") or {}
            if text is None:
                text = delta.get("content") or ""
            finish = choice.get("finish_reason") or finish
            logprobs = _chunk_logprobs(name, choice)
            calls = _chunk_tool_calls(name, delta)
            if text or logprobs or calls:
                yield TokenEvent(request_id=request_id, text=text, token_logprobs=logprobs, tool_calls=calls)
    if done:
        await _drain(lines)
    if not done and finish is None:
        raise BackendUnavailable(f"upstream {name!r} ended the stream before finishing")
    yield TokenEvent(request_id=request_id, finish_reason=finish or "stop", usage=usage or Usage())


def _chunk_logprobs(name: str, choice: dict[str, Any]) -> list[TokenLogprob] | None:
    try:
        return read_logprobs(choice.get("logprobs")) or None
    except (AttributeError, TypeError, ValueError, KeyError):
        raise UpstreamMalformed(f"upstream {name!r} sent malformed logprobs") from None


def _chunk_tool_calls(name: str, delta: dict[str, Any]) -> list[dict[str, Any]] | None:
    try:
        return _tool_calls(delta.get("tool_calls"))
    except (AttributeError, TypeError, ValueError):
        raise UpstreamMalformed(f"upstream {name!r} sent malformed tool calls") from None


def _message_json(m: ChatMessage) -> dict[str, Any]:
    """A chat turn as OpenAI servers take it, tool context included where the client sent it."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = m.tool_calls
        out["content"] = m.content or None  # an assistant turn that only called tools
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def _tool_calls(raw: Any) -> list[dict[str, Any]] | None:
    """An upstream's tool calls (or their stream deltas), checked to be OpenAI's shape: objects with
    an optional integer `index`, string `id` / `type`, and a `function` object of strings."""
    if not raw:
        return None
    if not isinstance(raw, list):
        raise ValueError("tool_calls is not a list")
    for call in raw:
        function = call.get("function", {}) if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise ValueError("a tool call or its function is not an object")
        texts = [call.get("id"), call.get("type"), function.get("name"), function.get("arguments")]
        if not all(t is None or isinstance(t, str) for t in texts):
            raise ValueError("a tool call's id, type, name or arguments is not a string")
        if not (call.get("index") is None or type(call.get("index")) is int):
            raise ValueError("a tool call's index is not an integer")
    return raw


async def _drain(lines: AsyncIterator[str]) -> None:
    """Read what follows [DONE] (normally just the end of the body), so the connection is pooled
    again; an upstream slow to end its answer only loses its connection, never the answer."""
    try:
        async with asyncio.timeout(DRAIN_S):
            async for _ in lines:
                pass
    except (TimeoutError, UpstreamUnreachable, UpstreamTooLong):
        pass


async def each_within(items: AsyncIterator[str], seconds: float) -> AsyncIterator[str]:
    """`items`, raising TimeoutError when the next one takes longer than `seconds` to come."""
    iterator = aiter(items)
    while True:
        try:
            async with asyncio.timeout(seconds):
                item = await anext(iterator)
        except StopAsyncIteration:
            return
        yield item
