"""OpenAI-compatible text endpoints: /v1/models, /v1/completions, /v1/chat/completions (+ SSE).

`model` may name `model`, `model:version` or `model@label`. Streams are Server-Sent Events
(`data: {...}` lines, `data: [DONE]` last); with `stream_options.include_usage` a final chunk with
empty `choices` carries the usage. A stream that breaks after its first token ends with an
`{"error": ...}` event and `[DONE]`, never a cut connection.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import msgspec
from litestar import Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from backends.base import TokenLogprob, Usage
from gateway import metrics
from gateway.calls import Call, ModelRef
from gateway.core import GatewayCore, GenerationInput, StartedGeneration
from gateway.errors import describe
from gateway.http import answer_json, http_failure, json_response, protocol_opt, read_body
from gateway.protocols.openai_choices import answer_choices, collect_choice, finish_reason
from gateway.protocols.openai_schema import (
    chat_decoder,
    chat_request,
    completion_decoder,
    completion_request,
    decode,
)
from gateway.streams import GenerationStream
from router.planner import split_model_name

OPENAI = protocol_opt("openai")
_encoder = msgspec.json.Encoder()
_STARTED = int(time.time())


@get("/v1/models", opt=OPENAI)
async def list_models(core: GatewayCore, call: Call) -> Response[bytes]:
    async def work() -> tuple[dict[str, Any], int]:
        principal = await core.identify(call)
        data = [
            {"id": m, "object": "model", "created": _STARTED, "owned_by": principal.tenant}
            for m in core.visible_models(principal)
        ]
        return {"object": "list", "data": data}, 200

    return await answer_json(call, work)


def _usage_json(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


class _Shape:
    """The few differences between the completions and chat completions wire shapes."""

    def __init__(self, chat: bool, model: str, request_id: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]], obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(
        self, text: str, finish: str | None, first: bool, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"content": text} if text or not first else {"content": ""}
            if first:
                delta["role"] = "assistant"
            choice = {
                "index": 0,
                "delta": delta,
                "finish_reason": finish,
                "logprobs": self.logprobs(logprobs),
            }
            return self._envelope([choice], "chat.completion.chunk")
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": self.logprobs(logprobs)}
        return self._envelope([choice], "text_completion")

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """OpenAI's logprobs object: chat's `content` list, or completions' parallel lists."""
        if entries is None:
            return None
        if self.chat:
            return {"content": [_chat_logprob(e) for e in entries], "refusal": None}
        offsets, at = [], 0
        for e in entries:
            offsets.append(at)
            at += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
        }

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._envelope([], obj), "usage": _usage_json(usage)}

    def whole(
        self, text: str, finish: str, usage: Usage, logprobs: list[TokenLogprob] | None = None
    ) -> dict[str, Any]:
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
                "logprobs": self.logprobs(logprobs),
            }
            return {**self._envelope([choice], "chat.completion"), "usage": _usage_json(usage)}
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": self.logprobs(logprobs)}
        return {**self._envelope([choice], "text_completion"), "usage": _usage_json(usage)}


def _chat_logprob(entry: TokenLogprob) -> dict[str, Any]:
    return {
        "token": entry.token,
        "logprob": entry.logprob,
        "bytes": entry.bytes,
        "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in entry.top],
    }


async def _sse(
    started: StartedGeneration, shape: _Shape, include_usage: bool, call: Call
) -> AsyncIterator[bytes]:
    events, deadline = started.stream, started.deadline
    first = True
    usage = Usage()
    pending: list[TokenLogprob] | None = None
    last = time.perf_counter()
    labels = (call.model, started.served.deployment.name)
    status = 200
    try:
        while True:
            # the deadline covers the wait for each event, never the yield to the client below
            async with deadline.scope():
                event = await anext(events, None)
            if event is None:
                break
            now = time.perf_counter()
            if event.text:
                if first:
                    metrics.TIME_TO_FIRST_TOKEN.labels(*labels).observe(now - call.started)
                else:
                    metrics.INTER_TOKEN_LATENCY.labels(*labels).observe(now - last)
                last = now
            if event.usage is not None:
                usage = event.usage
            if event.token_logprobs is not None:  # a chunk may carry tokens whose text is held back
                pending = (pending or []) + event.token_logprobs
            if event.text or first or event.finish_reason:
                finish = finish_reason(event.finish_reason) if event.finish_reason else None
                chunk = shape.chunk(event.text, finish, first, pending)
                yield b"data: " + _encoder.encode(chunk) + b"\n\n"
                first = False
                pending = None
        if include_usage:
            yield b"data: " + _encoder.encode(shape.usage_chunk(usage)) + b"\n\n"
    except Exception as exc:  # noqa: BLE001 - the stream has started: end it with an error event
        known = describe(exc)
        message = known[2] if known else "internal error; see the gateway log"
        code = known[1] if known else "internal_error"
        status = known[0] if known else 500
        yield (
            b"data: "
            + _encoder.encode({"error": {"message": message, "type": "server_error", "code": code}})
            + b"\n\n"
        )
    finally:
        call.done(status)
        # a client that went away: abort the generation and settle what it was given
        await events.aclose()
    yield b"data: [DONE]\n\n"


async def _generate(request: Request, core: GatewayCore, call: Call, chat: bool) -> Response[Any]:
    async def load() -> GenerationInput:
        raw = await read_body(
            request,
            core.config.server.max_body_bytes,
            allowed_types=("application/json", ""),
            headers=call.headers,
        )
        body = decode(raw, chat_decoder if chat else completion_decoder)
        model, version, label = split_model_name(body.model)

        def build() -> Any:
            gen = chat_request(body, call.request_id) if chat else completion_request(body, call.request_id)
            gen.stream = bool(body.stream)
            return gen

        return GenerationInput(ModelRef(model, version, label), build, body, n=body.n)

    try:
        started = await core.serve_generation(call, load)
        try:
            return await _answer(started, call, chat)
        except BaseException:
            await started.stream.aclose()
            raise
    except Exception as exc:  # noqa: BLE001
        return http_failure(call, exc)


async def _answer(started: StartedGeneration, call: Call, chat: bool) -> Response[Any]:
    """The response for a started generation: an SSE stream, or the whole completion.

    Every path ends with the events iterated to their end or closed, so the queue slot and the
    reservation are settled; for a stream, the response's background task closes it once the
    body is done, even when the server stopped iterating it (client disconnect).
    """
    body, events = started.body, started.stream
    out_headers = started.served.response_headers(call)
    shape = _Shape(chat, body.model, call.request_id)
    if len(started.streams) > 1:  # OpenAI `n`: several choices of one prompt
        return await answer_choices(started, shape, call, out_headers)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        sse = _sse(started, shape, include_usage, call)
        return Stream(
            sse,
            media_type="text/event-stream",
            headers={**out_headers, "cache-control": "no-cache"},
            background=BackgroundTask(_close_all, sse, events),
        )
    try:
        async with started.deadline.scope():
            text, finish, logprobs, usage = await collect_choice(events)
    finally:
        await events.aclose()
    call.done(200)
    return json_response(shape.whole(text, finish, usage, logprobs), headers=out_headers)


async def _close_all(sse: AsyncGenerator[bytes, None], events: GenerationStream) -> None:
    await sse.aclose()
    await events.aclose()


@post("/v1/completions", status_code=200, opt=OPENAI)
async def completions(request: Request, core: GatewayCore, call: Call) -> Response[Any]:
    return await _generate(request, core, call, chat=False)


@post("/v1/chat/completions", status_code=200, opt=OPENAI)
async def chat_completions(request: Request, core: GatewayCore, call: Call) -> Response[Any]:
    return await _generate(request, core, call, chat=True)


ROUTES = [list_models, completions, chat_completions]
