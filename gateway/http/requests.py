"""HTTP plumbing shared by the protocol adapters: the `core` and `call` dependencies, errors, answers,
and the bounded raw body read of the routes that do not take a typed body.

JSON bodies are Litestar's (typed `data`, gateway/http/bodies.py). `read_body` serves the tensor
routes, whose bodies are read after the queue-room step and may be the v2 binary extension
(docs/decisions/0001-raw-tensor-bodies.md) and the console's form. The hot inference routes answer
with `RawResponse`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import structlog
from litestar import Request, Response
from litestar.di import Provide

from fleetgate.errors import GatewayError, Protocol, describe
from gateway.core.calls import Call
from gateway.core.service import GatewayCore
from gateway.http.bodies import call_of, lower_headers
from gateway.http.errors import exception_response

__all__ = ["lower_headers"]  # re-exported: the admin guard reads headers as the adapters do

log = structlog.get_logger("fleetgate.access")
_encoder = msgspec.json.Encoder()

JSON_TYPES = ("application/json", "application/octet-stream", "")


async def read_body(
    request: Request,
    limit: int,
    *,
    allowed_types: tuple[str, ...] = JSON_TYPES,
    headers: Mapping[str, str] | None = None,
) -> bytes:
    """Read the body, refusing with 413 before reading more than `limit` bytes.

    A declared Content-Length over the limit is refused without reading anything; a chunked body
    is counted as it arrives and refused as soon as it passes the limit.

    Args:
        request: the request whose body is read (once: the ASGI channel is consumed).
        limit: the most bytes accepted.
        allowed_types: accepted content types (without parameters).
        headers: the request's headers from `lower_headers`, when the caller has them already.
    """
    if headers is None:
        headers = lower_headers(request)
    ctype = headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in allowed_types:
        raise GatewayError(
            415, "unsupported_media_type", f"content type {ctype!r} is not supported; send application/json"
        )
    declared = headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise GatewayError(
                    413, "body_too_large", f"request body of {declared} bytes exceeds {limit} bytes"
                )
        except ValueError:
            raise GatewayError(400, "bad_content_length", "Content-Length is not a number") from None
    # Straight from the ASGI channel: Litestar's stream() adds an async generator per request.
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await request.receive()
        if message["type"] != "http.request":  # http.disconnect: the client went away
            raise GatewayError(400, "client_disconnected", "the client closed the connection mid-body")
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise GatewayError(413, "body_too_large", f"request body exceeds {limit} bytes")
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


#: the largest body an admin or batch-creation route accepts (they carry a few small fields)
ADMIN_BODY_LIMIT = 64 * 1024


class RawResponse:
    """A complete response as a bare ASGI app, for the hot inference routes.

    Litestar turns a returned `Response` into an ASGI response on every call (header containers,
    media-type and cookie handling); this sends the two ASGI messages directly. Handlers return it
    under a `-> ASGIApp` annotation; error paths may still return a Litestar `Response`.
    """

    __slots__ = ("body", "headers", "status")

    def __init__(self, body: bytes, status: int, media_type: str, headers: Mapping[str, str]) -> None:
        self.body = body
        self.status = status
        self.headers = [
            (b"content-type", media_type.encode("latin-1")),
            (b"content-length", str(len(body)).encode("latin-1")),
            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()),
        ]

    @property
    def status_code(self) -> int:
        """The status, named as a Litestar `Response` names it (a batch line reads either)."""
        return self.status

    @property
    def content(self) -> bytes:
        """The body, named as a Litestar `Response` names it (a batch line reads either)."""
        return self.body

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        body = b"" if scope.get("method") == "HEAD" else self.body
        await send({"type": "http.response.body", "body": body, "more_body": False})




# --- dependencies (Litestar injects them by parameter name into every handler that asks) ------


def provide_core(request: Request) -> GatewayCore:
    """`core`: the process's live gateway core."""
    return request.app.state.core


def provide_call(request: Request, core: GatewayCore) -> Call:
    """`call`: the request as a protocol-neutral call; the protocol is the route's `opt["protocol"]`.
    The call the body hook opened (gateway/http/bodies.py) when there is one.

    `core` is unused: depending on it puts the two dependencies in separate batches, which Litestar
    resolves with a plain await each; dependencies of the same batch are resolved in an anyio task
    group, which cost about a fifth of the light model's throughput (py-spy, bench_gateway).
    """
    del core
    return call_of(request)


DEPENDENCIES = {
    "core": Provide(provide_core, sync_to_thread=False),
    "call": Provide(provide_call, sync_to_thread=False),
}


def protocol_opt(protocol: Protocol) -> dict[str, Any]:
    """A route's `opt`: which protocol envelope its `call` answers in."""
    return {"protocol": protocol}


def http_failure(call: Call, exc: BaseException) -> Response[bytes]:
    """Answer an exception in the call's protocol envelope and write its access-log line."""
    known = describe(exc)
    if known is None:
        log.exception("unhandled_error", request_id=call.request_id, exc_info=exc)
        call.done(500, "internal_error")
    else:
        call.done(known[0], known[1])
    response = exception_response(call.protocol, exc)
    response.headers["x-request-id"] = call.echo_id
    return response


async def answer_json(call: Call, work: Callable[[], Awaitable[tuple[Any, int]]]) -> Response[bytes]:
    """The skeleton of a JSON route: run `work` (returns the body and the status), record the call,
    and answer any exception in the call's protocol envelope."""
    try:
        body, status = await work()
    except Exception as exc:  # noqa: BLE001 - answered in the protocol's envelope
        return http_failure(call, exc)
    call.done(status)
    return json_response(body, status)


def raw_json_response(
    payload: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> RawResponse:
    """A JSON answer encoded by msgspec, sent as a bare ASGI app (`RawResponse`): the hot routes'
    successful answers, which skip Litestar's response conversion."""
    return RawResponse(_encoder.encode(payload), status, "application/json", headers or {})


def json_response(
    payload: Any, status: int = 200, headers: Mapping[str, str] | None = None
) -> Response[bytes]:
    """A JSON answer encoded by msgspec (the protocols' non-hot routes)."""
    return Response(
        content=_encoder.encode(payload),
        status_code=status,
        media_type="application/json",
        headers=dict(headers or {}),
    )
