"""Remote adapter: another server of the fleet, reached over pooled keep-alive HTTP (aiohttp).

Speaks OpenAI (another fleetgate, vLLM, TGI, any OpenAI-compatible server) or the Open Inference
Protocol v2 (another fleetgate, Triton, OpenVINO Model Server, KServe). A streamed text request is
streamed upstream too, so tokens are passed on as they arrive and never buffered whole; a request for
one answer asks the upstream for one JSON answer. Upstream errors and timeouts become clean gateway
errors; upstream bodies are never echoed verbatim beyond a short, single-line message.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from backends.base import (
    BatchObserver,
    Capability,
    GenerateRequest,
    ModelMetadata,
    TensorRequest,
    TensorResponse,
    TokenEvent,
    estimate_prompt_tokens,
)
from backends.errors import BackendTimeout, BackendUnavailable, InvalidInput
from backends.remote import kserve_upstream, openai_upstream
from backends.remote.client import UpstreamClient, UpstreamTooLong, UpstreamUnreachable
from backends.remote.errors import UpstreamIncomplete, UpstreamMalformed, UpstreamTooLarge, upstream_error
from backends.runtime.json_errors import JSON_DECODE_ERRORS
from backends.runtime.validation import validate_request
from backends.spec import DeploymentSpec, SpecBase, decode_options
from fleetgate import tracing


class RemoteOptions(SpecBase):
    #: connections to the upstream at most, all kept alive between requests
    max_connections: int = 64
    #: seconds to open one connection; an upstream slower than that is unreachable (503, fallbacks)
    connect_timeout_s: float = 5.0
    #: the most bytes read of one upstream answer (and of one stream line): a larger one is a 502,
    #: so a broken or hostile upstream cannot make the gateway buffer without bound
    max_response_bytes: int = 64 * 1024 * 1024


_json_decode = msgspec.json.Decoder()
_json_encode = msgspec.json.Encoder()


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
        self._client: UpstreamClient | None = None
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
        self._client = UpstreamClient(
            self.spec.url or "",
            headers,
            max_connections=self.options.max_connections,
            connect_timeout_s=self.options.connect_timeout_s,
        )
        if self.protocol == "kserve_v2":
            try:
                meta = await self._request("GET", kserve_upstream.metadata_path(self._upstream_model))
                self._meta = kserve_upstream.metadata_from(self.name, self.spec.url, self._upstream_model, meta)
            except BaseException:
                # a load that fails is retried with a new client: this one's connections end here
                await self.close()
                raise
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

    async def _exchange(self, method: str, path: str, content: bytes | None) -> bytes:
        """One whole exchange within the deployment's `timeout_s` (the answer's head and body under
        one timer): the answer's bytes, or a gateway error."""
        assert self._client is not None, "load() first"
        timeout_s = self.spec.timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                # this timer bounds the whole exchange: no per-read timer of the client's on top
                response = await self._client.request(method, path, content, _headers(content), None)
                try:
                    status, raw = response.status, await response.read(self.options.max_response_bytes)
                finally:
                    await response.aclose()
        except TimeoutError:
            raise BackendTimeout(f"upstream {self.name!r} did not answer in {timeout_s:g}s") from None
        except UpstreamUnreachable as exc:
            raise BackendUnavailable(f"upstream {self.name!r} unreachable: {exc}") from None
        except UpstreamTooLong as exc:
            raise UpstreamTooLarge(f"upstream {self.name!r}: {exc}") from None
        if status >= 400:
            raise upstream_error(status, raw)
        return raw

    async def _request(self, method: str, path: str, body: Any = None) -> Any:
        """One JSON exchange (`_exchange`): the answer decoded."""
        raw = await self._exchange(method, path, _json_encode.encode(body) if body is not None else None)
        try:
            return _json_decode.decode(raw)
        except JSON_DECODE_ERRORS:
            raise UpstreamMalformed(f"upstream {self.name!r} sent a body that is not JSON") from None

    async def infer(self, request: TensorRequest) -> TensorResponse:
        if self.protocol != "kserve_v2":
            raise InvalidInput(f"deployment {self.name!r} generates text; it does not take tensors")
        validate_request(request, self.metadata())
        body = kserve_upstream.infer_body(request)
        answer = await self._request("POST", kserve_upstream.infer_path(self._upstream_model), body)
        return kserve_upstream.response_from(self.name, request.id, answer)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent]:
        if self.protocol != "openai":
            raise InvalidInput(f"deployment {self.name!r} serves tensors, not text generation")
        assert self._client is not None, "load() first"
        path, body = openai_upstream.request_body(request, self._upstream_model)
        if not request.stream:  # one JSON answer under one timer: no event framing to parse
            raw = await self._exchange("POST", path, _json_encode.encode(body))
            answer = openai_upstream.whole_answer(self.name, request.request_id, raw)
            if request.sampling.logprobs and answer.token_logprobs is None:
                # never hand back an answer without what the caller asked for, silently
                raise UpstreamIncomplete(f"upstream {self.name!r} did not send the logprobs asked for")
            yield answer
            return
        limit = self.options.max_response_bytes
        timeout_s = self.spec.timeout_s
        content = _json_encode.encode(body)
        try:
            # the deadline of the stream's head; each later event has the same allowance
            async with asyncio.timeout(timeout_s):
                # the head under this timer, each event under `each_within`'s: no per-read timer on top
                response = await self._client.request("POST", path, content, _headers(content), None)
        except TimeoutError:
            raise BackendTimeout(f"upstream {self.name!r} did not answer in {timeout_s:g}s") from None
        except UpstreamUnreachable as exc:
            raise BackendUnavailable(f"upstream {self.name!r} failed: {exc}") from None
        try:
            if response.status >= 400:
                async with asyncio.timeout(timeout_s):  # an error body that stalls is a timeout too
                    raise upstream_error(response.status, await response.read(limit))
            lines = openai_upstream.each_within(response.lines(limit), timeout_s)
            async for event in openai_upstream.parse_sse(self.name, request.request_id, lines):
                if request.sampling.logprobs and event.text and not event.token_logprobs:
                    raise UpstreamIncomplete(f"upstream {self.name!r} did not send the logprobs asked for")
                yield event
        except TimeoutError:
            raise BackendTimeout(f"upstream {self.name!r} sent nothing for {timeout_s:g}s") from None
        except UpstreamUnreachable as exc:
            raise BackendUnavailable(f"upstream {self.name!r} failed: {exc}") from None
        except UpstreamTooLong as exc:
            raise UpstreamTooLarge(f"upstream {self.name!r}: {exc}") from None
        finally:
            await response.aclose()  # a no-op once the answer was read to its end


def _headers(content: bytes | None) -> dict[str, str] | None:
    """A request's own headers: its JSON body's type, and the trace going on upstream (W3C
    traceparent; nothing while tracing is off)."""
    return {**({"content-type": "application/json"} if content else {}), **tracing.trace_headers()} or None


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
