"""OpenAI-compatible text endpoints: /v1/models, /v1/completions, /v1/chat/completions (+ SSE).

`model` may name `model`, `model:version` or `model@label`. Streams are Server-Sent Events
(`data: {...}` lines, `data: [DONE]` last); with `stream_options.include_usage` a final chunk with
empty `choices` carries the usage. A stream that breaks after its first token ends with an
`{"error": ...}` event and `[DONE]`, never a cut connection.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, get, post
from litestar.params import Body
from litestar.response import Stream
from litestar.types import ASGIApp

from backends.base import TokenLogprob, Usage
from gateway.core.calls import Call, ModelRef
from gateway.core.results import GenerationInput, StartedGeneration
from gateway.core.service import GatewayCore
from gateway.http.api_docs import KEYED, OPENAI_ERRORS, Completion, answers
from gateway.http.bodies import keyed_body
from gateway.http.openai_choices import answer_choices
from gateway.http.requests import answer_json, http_failure, protocol_opt
from gateway.wire.openai_schema import (
    ChatBody,
    CompletionBody,
    chat_decoder,
    chat_request,
    completion_decoder,
    completion_request,
    decode,
)
from router.planner import split_model_name

OPENAI = protocol_opt("openai")
_encoder = msgspec.json.Encoder()
_STARTED = int(time.time())


@get("/v1/models", opt=OPENAI, responses=OPENAI_ERRORS, security=KEYED)
async def list_models(core: GatewayCore, call: Call) -> Response[bytes]:
    async def work() -> tuple[dict[str, Any], int]:
        principal = await core.identify(call)
        data = []
        for m in core.visible_models(principal):
            entry = {"id": m, "object": "model", "created": _STARTED, "owned_by": principal.tenant}
            parent = core.adapter_parent(m)
            if parent is not None:  # a LoRA adapter: its base model, as vLLM lists them
                entry["parent"] = parent
            data.append(entry)
        return {"object": "list", "data": data}, 200

    return await answer_json(call, work)


def _usage_json(usage: Usage) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
    if usage.cached_prompt_tokens:  # OpenAI's place for them; left out where none were reported
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_prompt_tokens}
    return body


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
        self,
        text: str,
        finish: str | None,
        first: bool,
        logprobs: list[TokenLogprob] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"content": text if text or not tool_calls else None}
            if first:
                # as OpenAI's first delta: the role, and no refusal (this gateway never refuses in text)
                delta["role"] = "assistant"
                delta["refusal"] = None
            if tool_calls:
                delta["tool_calls"] = tool_calls
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
        self,
        text: str,
        finish: str,
        usage: Usage,
        logprobs: list[TokenLogprob] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        if self.chat:
            # `refusal` is required by OpenAI's published description (null: the model did not
            # refuse); clients generated from it reject a message without it
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text or (None if tool_calls else ""),
                "refusal": None,
            }
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {
                "index": 0,
                "message": message,
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


async def generate_route(request: Request, core: GatewayCore, call: Call, chat: bool, body: Any) -> ASGIApp:
    """`/v1/(chat/)completions`, as Litestar's routes call it with the body it decoded."""

    async def given() -> Any:
        return body

    answer = await generate_decoded(core, call, chat, given)
    if isinstance(answer, Stream):
        # an SSE stream keeps its own media type: Litestar would give it the route's (JSON)
        return answer.to_asgi_response(request.app, request, media_type=answer.media_type)
    return answer


async def generate(
    core: GatewayCore, call: Call, chat: bool, read: Callable[[], Awaitable[bytes]]
) -> ASGIApp:
    """Serve a (chat) completion whose JSON body `read` returns: a batch job's line
    (gateway/batches), with the body from its input file. Every failure is answered in OpenAI's
    envelope."""

    async def decoded() -> Any:
        return decode(await read(), chat_decoder if chat else completion_decoder)

    return await generate_decoded(core, call, chat, decoded)


async def generate_decoded(
    core: GatewayCore, call: Call, chat: bool, body_of: Callable[[], Awaitable[Any]]
) -> ASGIApp:
    """Serve a (chat) completion whose decoded body (ChatBody or CompletionBody) `body_of`
    returns, inside the core's load step. Every failure is answered in OpenAI's envelope."""

    async def load() -> GenerationInput:
        body = await body_of()
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


async def _answer(started: StartedGeneration, call: Call, chat: bool) -> ASGIApp:
    """The response for a started generation (gateway/http/openai_choices.py, any `n`)."""
    shape = _Shape(chat, started.body.model, call.request_id)
    return await answer_choices(started, shape, call, started.served.response_headers(call))


#: what a client route states in the OpenAPI document besides its signature
_DOCUMENTED: dict[str, Any] = {"responses": answers(Completion, OPENAI_ERRORS), "security": KEYED}
#: typed bodies: the key is checked, then the body read under the call's deadline, then decoded
_TYPED: dict[str, Any] = {"before_request": keyed_body, **_DOCUMENTED}


@post("/v1/completions", status_code=200, opt=OPENAI, **_TYPED)
async def completions(
    request: Request,
    core: GatewayCore,
    call: Call,
    data: Annotated[CompletionBody, Body(title="Completion request", description="OpenAI's completions body")],
) -> ASGIApp:
    return await generate_route(request, core, call, False, data)


@post("/v1/chat/completions", status_code=200, opt=OPENAI, **_TYPED)
async def chat_completions(
    request: Request,
    core: GatewayCore,
    call: Call,
    data: Annotated[ChatBody, Body(title="Chat completion request", description="OpenAI's chat body")],
) -> ASGIApp:
    return await generate_route(request, core, call, True, data)


ROUTES = [list_models, completions, chat_completions]
