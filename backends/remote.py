"""Remote adapter: another server of the fleet, reached over pooled keep-alive HTTP.

Speaks OpenAI (another fleetgate, vLLM, TGI, any OpenAI-compatible server) or the Open Inference
Protocol v2 (another fleetgate, Triton, OpenVINO Model Server, KServe). A streamed text request is
streamed upstream too, so tokens are passed on as they arrive and never buffered whole; a request for
one answer asks the upstream for one JSON answer. Upstream errors
and timeouts become clean gateway errors; upstream bodies are never echoed verbatim beyond a short,
single-line message.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import numpy as np

from backends.base import (
    V2_TO_NUMPY,
    BatchObserver,
    Capability,
    ChatMessage,
    GenerateRequest,
    ModelMetadata,
    Tensor,
    TensorRequest,
    TensorResponse,
    TensorSpec,
    TokenEvent,
    TokenLogprob,
    Usage,
    estimate_prompt_tokens,
)
from backends.errors import (
    BackendError,
    BackendInternalError,
    BackendTimeout,
    BackendUnavailable,
    InvalidInput,
    ModelNotFound,
)
from backends.json_errors import JSON_DECODE_ERRORS
from backends.openai_logprobs import read_logprobs
from backends.spec import DeploymentSpec, SpecBase, decode_options
from backends.upstream_http import UpstreamPool, UpstreamTooLong, UpstreamUnreachable
from backends.validation import validate_request
from fleetgate import tracing


class RemoteOptions(SpecBase):
    max_connections: int = 64
    connect_timeout_s: float = 5.0
    #: the most bytes read of one upstream answer (and of one stream line): a larger one is a 502,
    #: so a broken or hostile upstream cannot make the gateway buffer without bound
    max_response_bytes: int = 64 * 1024 * 1024


class UpstreamTooLarge(BackendInternalError):
    """The upstream's answer passed `max_response_bytes` (a fault of the deployment)."""

    status = 502
    code = "upstream_too_large"


class UpstreamMalformed(BackendInternalError):
    """The upstream's answer is not what its protocol says (a fault of the deployment: bad gateway)."""

    status = 502
    code = "upstream_malformed"


class UpstreamIncomplete(BackendInternalError):
    """The upstream answered without something the call asked for (e.g. logprobs)."""

    status = 502
    code = "upstream_incomplete"


_json_decode = msgspec.json.Decoder()
_json_encode = msgspec.json.Encoder()


def _upstream_error(status: int, body: bytes) -> BackendError:
    """Map an upstream HTTP error to a gateway error with a short, safe message."""
    try:
        payload = _json_decode.decode(body)
        err = payload.get("error", payload) if isinstance(payload, dict) else payload
        detail = err.get("message", "") if isinstance(err, dict) else str(err)
    except (*JSON_DECODE_ERRORS, AttributeError):
        detail = ""
    detail = " ".join(str(detail).split())[:200]
    message = f"upstream answered {status}" + (f": {detail}" if detail else "")
    if status == 400 or status == 422:
        return InvalidInput(message)
    if status == 404:
        return ModelNotFound(message)
    if status == 504:
        return BackendTimeout(message)
    if status in (401, 403):
        # the gateway's own credentials were refused (a revoked or wrong upstream key): a fault of
        # this deployment, never the caller's, and another route may well serve
        return BackendUnavailable(f"upstream refused the gateway's credentials ({status})")
    if status in (429, 502, 503) or status >= 500:
        return BackendUnavailable(message)
    return BackendInternalError(message)


class RemoteBackend:
    """Forwards requests to `spec.url` using `spec.protocol`.

    A `TensorBackend` for a `kserve_v2` upstream, a `GenerativeBackend` for an `openai` one. The
    upstream tokenizes on its side, so prompt counts are estimates settled by its reported usage.
    """

    counts_prompt_tokens = False

    def __init__(self, name: str, spec: DeploymentSpec, options: RemoteOptions, api_key: str | None) -> None:
        self.name = name
        self.spec = spec
        self.options = options
        self.protocol = spec.protocol or "openai"
        self.capabilities = frozenset(
            {Capability.GENERATE} if self.protocol == "openai" else {Capability.TENSOR}
        )
        self._api_key = api_key
        self._client: UpstreamPool | None = None
        self._meta: ModelMetadata | None = None
        self._upstream_model = spec.model_name or name
        #: no runtime batcher here: the upstream batches on its side
        self.batch_observer: BatchObserver | None = None
        #: the upstream's free room is not known here: its own queue absorbs what it cannot run
        self.capacity: Callable[[], tuple[int, int]] | None = None

    @property
    def ready(self) -> bool:
        return self._client is not None and self._meta is not None

    def metadata(self) -> ModelMetadata:
        if self._meta is None:
            raise BackendUnavailable(f"deployment {self.name!r} is not loaded")
        return self._meta

    async def load(self) -> None:
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._client = UpstreamPool(
            self.spec.url or "",
            headers,
            max_connections=self.options.max_connections,
            connect_timeout_s=self.options.connect_timeout_s,
        )
        if self.protocol == "kserve_v2":
            self._meta = await self._fetch_v2_metadata()
        else:
            self._meta = ModelMetadata(
                name=self.name,
                platform="openai_remote",
                inputs=[],
                outputs=[],
                device="remote",
                extra={"url": self.spec.url, "upstream_model": self._upstream_model},
            )

    async def warmup(self) -> None:
        return None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def abort(self, request_id: str) -> None:
        # Closing the upstream stream (done by the generator's finally) is the abort.
        return None

    async def count_prompt_tokens(self, request: GenerateRequest) -> int:
        return estimate_prompt_tokens(request)

    # --- HTTP plumbing -----------------------------------------------------------------------

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        assert self._client is not None, "load() first"
        content = _json_encode.encode(body) if body is not None else None
        # the request's trace goes on upstream (W3C traceparent); nothing while tracing is off
        headers = {
            **({"content-type": "application/json"} if content else {}),
            **tracing.trace_headers(),
        } or None
        try:
            async with asyncio.timeout(self.spec.timeout_s):
                response = await self._client.request(method, path, content, headers)
                try:
                    status, raw = response.status, await response.read(self.options.max_response_bytes)
                finally:
                    response.close()
        except TimeoutError:
            raise BackendTimeout(
                f"upstream {self.name!r} did not answer in {self.spec.timeout_s:g}s"
            ) from None
        except UpstreamUnreachable as exc:
            raise BackendUnavailable(f"upstream {self.name!r} unreachable: {exc}") from None
        except UpstreamTooLong as exc:
            raise UpstreamTooLarge(f"upstream {self.name!r}: {exc}") from None
        if status >= 400:
            raise _upstream_error(status, raw)
        try:
            return _json_decode.decode(raw)
        except JSON_DECODE_ERRORS:
            raise UpstreamMalformed(f"upstream {self.name!r} sent a body that is not JSON") from None

    # --- Open Inference Protocol v2 ----------------------------------------------------------

    async def _fetch_v2_metadata(self) -> ModelMetadata:
        meta = await self._request("GET", f"/v2/models/{self._upstream_model}")
        try:

            def specs(items: list[dict[str, Any]]) -> list[TensorSpec]:
                return [
                    TensorSpec(
                        name=i["name"], datatype=i["datatype"], shape=tuple(int(d) for d in i["shape"])
                    )
                    for i in items
                ]

            return ModelMetadata(
                name=self.name,
                platform=str(meta.get("platform", "remote")),
                inputs=specs(meta.get("inputs", [])),
                outputs=specs(meta.get("outputs", [])),
                device="remote",
                extra={"url": self.spec.url, "upstream_model": self._upstream_model},
            )
        except (KeyError, TypeError, ValueError):
            raise UpstreamMalformed(f"upstream {self.name!r} sent malformed model metadata") from None

    async def infer(self, request: TensorRequest) -> TensorResponse:
        if self.protocol != "kserve_v2":
            raise InvalidInput(f"deployment {self.name!r} generates text; it does not take tensors")
        validate_request(request, self.metadata())
        body: dict[str, Any] = {
            "id": request.id,
            "inputs": [
                {
                    "name": t.name,
                    "shape": list(t.shape),
                    "datatype": t.datatype,
                    "data": _to_json_list(t.data, t.datatype),
                }
                for t in request.inputs
            ],
        }
        if request.outputs is not None:
            body["outputs"] = [{"name": n} for n in request.outputs]
        answer = await self._request("POST", f"/v2/models/{self._upstream_model}/infer", body)
        try:
            outputs = [
                Tensor(
                    name=o["name"],
                    datatype=o["datatype"],
                    shape=tuple(o["shape"]),
                    data=_from_json_list(o["data"], o["datatype"], tuple(o["shape"])),
                )
                for o in answer["outputs"]
            ]
        except (KeyError, TypeError, ValueError):
            raise UpstreamMalformed(
                f"upstream {self.name!r} sent a malformed inference response"
            ) from None
        return TensorResponse(id=request.id, outputs=outputs)

    # --- OpenAI ------------------------------------------------------------------------------

    def _openai_body(self, request: GenerateRequest) -> tuple[str, dict[str, Any]]:
        """The upstream call for `request`; what no OpenAI server could accept is refused here (400)."""
        given = [x for x in (request.prompt, request.prompt_token_ids, request.messages) if x is not None]
        if len(given) != 1:
            raise InvalidInput("give exactly one of prompt, prompt_token_ids or messages")
        s = request.sampling
        if s.max_tokens < 1:
            raise InvalidInput(f"max_tokens must be >= 1, got {s.max_tokens}")
        body: dict[str, Any] = {
            "model": request.upstream_model or self._upstream_model,
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

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        if self.protocol != "openai":
            raise InvalidInput(f"deployment {self.name!r} serves tensors, not text generation")
        assert self._client is not None, "load() first"
        path, body = self._openai_body(request)
        limit = self.options.max_response_bytes
        headers = {"content-type": "application/json", **tracing.trace_headers()}
        try:
            # the deadline of the answer's start; each later event has the same allowance
            async with asyncio.timeout(self.spec.timeout_s):
                response = await self._client.request("POST", path, _json_encode.encode(body), headers)
        except TimeoutError:
            raise BackendTimeout(
                f"upstream {self.name!r} did not answer in {self.spec.timeout_s:g}s"
            ) from None
        except UpstreamUnreachable as exc:
            raise BackendUnavailable(f"upstream {self.name!r} failed: {exc}") from None
        try:
            if response.status >= 400:
                raise _upstream_error(response.status, await response.read(limit))
            if not request.stream:  # one JSON answer: no event framing to parse
                async with asyncio.timeout(self.spec.timeout_s):
                    raw = await response.read(limit)
                answer = self._whole_answer(request.request_id, raw)
                if request.sampling.logprobs and answer.token_logprobs is None:
                    # never hand back an answer without what the caller asked for, silently
                    raise UpstreamIncomplete(f"upstream {self.name!r} did not send the logprobs asked for")
                yield answer
                return
            lines = _each_within(response.lines(limit), self.spec.timeout_s)
            async for event in self._parse_sse(request.request_id, lines):
                if request.sampling.logprobs and event.text and not event.token_logprobs:
                    raise UpstreamIncomplete(f"upstream {self.name!r} did not send the logprobs asked for")
                yield event
        except TimeoutError:
            raise BackendTimeout(
                f"upstream {self.name!r} sent nothing for {self.spec.timeout_s:g}s"
            ) from None
        except UpstreamUnreachable as exc:
            raise BackendUnavailable(f"upstream {self.name!r} failed: {exc}") from None
        except UpstreamTooLong as exc:
            raise UpstreamTooLarge(f"upstream {self.name!r}: {exc}") from None
        finally:
            response.close()  # a no-op once the answer was read to its end

    def _whole_answer(self, request_id: str, raw: bytes) -> TokenEvent:
        """The one event of a non-streamed OpenAI answer: its text, finish reason and usage."""
        try:
            payload = _json_decode.decode(raw)
            choice = (payload.get("choices") or [{}])[0]
            text = choice.get("text")
            message = choice.get("message") or {}
            if text is None:
                text = message.get("content") or ""
            tool_calls = _tool_calls(message.get("tool_calls"))
            u = payload.get("usage") or {}
            usage = Usage(
                prompt_tokens=int(u.get("prompt_tokens", 0)),
                completion_tokens=int(u.get("completion_tokens", 0)),
            )
            logprobs = read_logprobs(choice.get("logprobs"))
        except (*JSON_DECODE_ERRORS, AttributeError, TypeError, ValueError, IndexError, KeyError):
            raise UpstreamMalformed(f"upstream {self.name!r} sent a malformed completion") from None
        finish = choice.get("finish_reason") or "stop"
        return TokenEvent(
            request_id=request_id, text=str(text), finish_reason=finish, usage=usage,
            token_logprobs=logprobs, tool_calls=tool_calls,
        )  # fmt: skip

    async def _parse_sse(self, request_id: str, lines: AsyncIterator[str]) -> AsyncIterator[TokenEvent]:
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
                raise UpstreamMalformed(f"upstream {self.name!r} sent a malformed stream event") from None
            if chunk.get("error"):
                raise _upstream_error(502, _json_encode.encode(chunk))
            if chunk.get("usage"):
                u = chunk["usage"]
                usage = Usage(
                    prompt_tokens=int(u.get("prompt_tokens", 0)),
                    completion_tokens=int(u.get("completion_tokens", 0)),
                )
            for choice in chunk.get("choices") or []:
                text = choice.get("text")
                delta = choice.get("delta") or {}
                if text is None:
                    text = delta.get("content") or ""
                finish = choice.get("finish_reason") or finish
                logprobs = self._chunk_logprobs(choice)
                calls = self._chunk_tool_calls(delta)
                if text or logprobs or calls:
                    yield TokenEvent(request_id=request_id, text=text, token_logprobs=logprobs, tool_calls=calls)
        if done:
            await _drain(lines)
        if not done and finish is None:
            raise BackendUnavailable(f"upstream {self.name!r} ended the stream before finishing")
        yield TokenEvent(request_id=request_id, finish_reason=finish or "stop", usage=usage or Usage())

    def _chunk_logprobs(self, choice: dict[str, Any]) -> list[TokenLogprob] | None:
        try:
            return read_logprobs(choice.get("logprobs")) or None
        except (AttributeError, TypeError, ValueError, KeyError):
            raise UpstreamMalformed(f"upstream {self.name!r} sent malformed logprobs") from None


    def _chunk_tool_calls(self, delta: dict[str, Any]) -> list[dict[str, Any]] | None:
        try:
            return _tool_calls(delta.get("tool_calls"))
        except (AttributeError, TypeError, ValueError):
            raise UpstreamMalformed(f"upstream {self.name!r} sent malformed tool calls") from None


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


#: after [DONE], how long the rest of the answer may take to end before its connection is dropped
_DRAIN_S = 1.0


async def _drain(lines: AsyncIterator[str]) -> None:
    """Read what follows [DONE] (normally just the end of the body), so the connection is pooled
    again; an upstream slow to end its answer only loses its connection, never the answer."""
    try:
        async with asyncio.timeout(_DRAIN_S):
            async for _ in lines:
                pass
    except (TimeoutError, UpstreamUnreachable, UpstreamTooLong):
        pass


async def _each_within(items: AsyncIterator[str], seconds: float) -> AsyncIterator[str]:
    """`items`, raising TimeoutError when the next one takes longer than `seconds` to come."""
    iterator = aiter(items)
    while True:
        try:
            async with asyncio.timeout(seconds):
                item = await anext(iterator)
        except StopAsyncIteration:
            return
        yield item


def _to_json_list(data: np.ndarray, datatype: str) -> list[Any]:
    flat = data.reshape(-1)
    if datatype == "BYTES":
        return [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in flat]
    return flat.tolist()


def _from_json_list(values: list[Any], datatype: str, shape: tuple[int, ...]) -> np.ndarray:
    if datatype == "BYTES":
        return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=object).reshape(
            shape
        )
    return np.asarray(values, dtype=V2_TO_NUMPY[datatype]).reshape(shape)


def create(name: str, spec: DeploymentSpec) -> RemoteBackend:
    """Validate a remote deployment (URL, protocol, key variable); connects only in `load()`."""
    if not spec.url or not spec.url.startswith(("http://", "https://")):
        raise ValueError("url: an http:// or https:// base URL is required for backend remote")
    api_key = None
    if spec.api_key_env:
        api_key = os.environ.get(spec.api_key_env)
        if not api_key:
            raise ValueError(f"api_key_env: environment variable {spec.api_key_env} is not set")
    options = decode_options(spec.options, RemoteOptions)
    return RemoteBackend(name, spec, options, api_key)
