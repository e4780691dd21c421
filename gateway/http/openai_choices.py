"""The answer to a started OpenAI generation, whole or as Server-Sent Events, for one choice or `n`.

Each choice is a generation of its own (the engine shares the prompt's KV blocks through its prefix
cache); the core admits them together and settles them once (`ChoiceShare`). Here their events are
read concurrently: a whole answer lists the choices by index, a stream interleaves their chunks as
they come, each chunk naming its choice's index. Usage counts the prompt once and every choice's
completion.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream
from litestar.types import ASGIApp

from backends.base import TokenEvent, TokenLogprob, Usage
from fleetgate.errors import describe
from gateway.core.calls import Call
from gateway.core.results import StartedGeneration
from gateway.core.streams import GenerationStream
from gateway.http.requests import raw_json_response
from gateway.observe import metrics

_encoder = msgspec.json.Encoder()


#: finish reasons handed on as they come (an upstream's tool calls, its content filter)
_KEPT_REASONS = frozenset({"length", "tool_calls", "content_filter"})


def finish_reason(reason: str | None) -> str:
    """OpenAI's finish reason for a backend's: `length`, an upstream's `tool_calls` or
    `content_filter`, or `stop` for every other ending (stop, abort, error)."""
    return reason if reason in _KEPT_REASONS else "stop"


def merge_tool_calls(calls: list[dict[str, Any]] | None, new: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`calls` with `new` added: whole calls are appended; stream deltas (by `index`) are joined
    into the call of their index, their argument pieces concatenated."""
    merged = list(calls or [])
    by_index = {c["index"]: c for c in merged if "index" in c}
    for call in new:
        index = call.get("index")
        if index is None or index not in by_index:
            copy = {**call, "function": dict(call.get("function") or {})}
            merged.append(copy)
            if index is not None:
                by_index[index] = copy
            continue
        function = by_index[index].setdefault("function", {})
        piece = (call.get("function") or {}).get("arguments") or ""
        function["arguments"] = (function.get("arguments") or "") + piece
    return merged


def _total(usages: list[Usage]) -> Usage:
    """The usage of `n` choices of one prompt: the prompt once, every choice's output; as cached,
    what every choice found cached (the least: never more than one prompt's computation saved)."""
    return Usage(
        prompt_tokens=max((u.prompt_tokens for u in usages), default=0),
        completion_tokens=sum(u.completion_tokens for u in usages),
        cached_prompt_tokens=min((u.cached_prompt_tokens for u in usages), default=0),
    )


class WholeChoice(msgspec.Struct):
    """One choice of a whole answer."""

    text: str
    finish: str
    logprobs: list[TokenLogprob] | None
    usage: Usage
    tool_calls: list[dict[str, Any]] | None


async def collect_choices(streams: list[GenerationStream]) -> list[WholeChoice]:
    """Every choice, whole, in order: read side by side, each in a task of `gather`'s, when there
    are several; the usual single choice is read in the caller's task (a task a request saved)."""
    if len(streams) == 1:
        return [await collect_choice(streams[0])]
    return list(await asyncio.gather(*(collect_choice(s) for s in streams)))


async def collect_choice(stream: GenerationStream) -> WholeChoice:
    """A whole choice: its text, finish reason, logprobs entries (if asked), usage and tool calls."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    usage, finish = Usage(), "stop"
    async for event in stream:
        parts.append(event.text)
        if event.token_logprobs is not None:
            logprobs = (logprobs or []) + event.token_logprobs
        if event.tool_calls:
            tool_calls = merge_tool_calls(tool_calls, event.tool_calls)
        if event.usage is not None:
            usage = event.usage
        if event.finish_reason:
            finish = finish_reason(event.finish_reason)
    return WholeChoice("".join(parts), finish, logprobs, usage, tool_calls)


async def _merged(streams: list[GenerationStream]) -> AsyncIterator[tuple[int, TokenEvent | None]]:
    """Every choice's events as they come, `(index, event)`; `(index, None)` when one ends.

    One choice (the common case) is read directly; several are read by one task each."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        yield 0, None
        return
    queue: asyncio.Queue[tuple[int, TokenEvent | None] | BaseException] = asyncio.Queue()

    async def pump(index: int, stream: GenerationStream) -> None:
        try:
            async for event in stream:
                await queue.put((index, event))
            await queue.put((index, None))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item[1] is None:
                open_streams -= 1
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def answer_choices(
    started: StartedGeneration, shape: Any, call: Call, headers: dict[str, str]
) -> ASGIApp:
    """The response for the started choices: SSE when the body asks for a stream, else whole.

    Every path ends with every choice iterated to its end or closed, so the queue and the reservation
    are settled; for a stream, the response's background task closes them once the body is done, even
    when the server stopped iterating it (client disconnect)."""
    streams, body = started.streams, started.body
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        sse = _sse(started, shape, include_usage, call)
        return Stream(
            sse,
            media_type="text/event-stream",
            headers={**headers, "cache-control": "no-cache"},
            background=BackgroundTask(_close, sse, streams),
        )
    try:
        async with started.deadline.scope():
            answers = await collect_choices(streams)
    finally:
        await _close(None, streams)
    whole = shape.whole("", "stop", _total([a.usage for a in answers]))
    choices = []
    for index, a in enumerate(answers):
        choice = shape.whole(a.text, a.finish, a.usage, a.logprobs, a.tool_calls)["choices"][0]
        choice["index"] = index
        choices.append(choice)
    whole["choices"] = choices
    call.done(200)
    return raw_json_response(whole, headers=headers)


async def _sse(
    started: StartedGeneration, shape: Any, include_usage: bool, call: Call
) -> AsyncIterator[bytes]:
    streams = started.streams
    first = [True] * len(streams)
    usages = [Usage() for _ in streams]
    pending: list[list[TokenLogprob] | None] = [None] * len(streams)
    last = [0.0] * len(streams)
    labels = (call.model, started.served.deployment.name)
    status = 200
    events = _merged(streams)
    try:
        while True:
            async with started.deadline.scope():
                item = await anext(events, None)
            if item is None:
                break
            index, event = item
            if event is None:
                continue
            if event.text:
                now = time.perf_counter()
                if first[index]:
                    metrics.TIME_TO_FIRST_TOKEN.labels(*labels).observe(now - call.started)
                else:
                    metrics.INTER_TOKEN_LATENCY.labels(*labels).observe(now - last[index])
                last[index] = now
            if event.usage is not None:
                usages[index] = event.usage
            if event.token_logprobs is not None:
                pending[index] = (pending[index] or []) + event.token_logprobs
            if event.text or first[index] or event.finish_reason or event.tool_calls:
                finish = finish_reason(event.finish_reason) if event.finish_reason else None
                chunk = shape.chunk(event.text, finish, first[index], pending[index], event.tool_calls)
                chunk["choices"][0]["index"] = index
                yield b"data: " + _encoder.encode(chunk) + b"\n\n"
                first[index] = False
                pending[index] = None
        if include_usage:
            yield b"data: " + _encoder.encode(shape.usage_chunk(_total(usages))) + b"\n\n"
    except Exception as exc:  # noqa: BLE001 - the stream has started: end it with an error event
        known = describe(exc)
        status = known[0] if known else 500
        error = {
            "message": known[2] if known else "internal error; see the gateway log",
            "type": "server_error",
            "code": known[1] if known else "internal_error",
            "param": None,  # required by OpenAI's Error description, as in every other error answer
        }
        yield b"data: " + _encoder.encode({"error": error}) + b"\n\n"
    finally:
        call.done(status)
        await events.aclose()
        await _close(None, streams)
    yield b"data: [DONE]\n\n"


async def _close(sse: Any, streams: list[GenerationStream]) -> None:
    """Close the SSE generator (if any) and every choice: each settles its part once."""
    if sse is not None:
        await sse.aclose()
    for stream in streams:
        await stream.aclose()
