"""Typed request bodies through Litestar, keeping what the gateway's own body reads gave.

A typed route declares its body as `data: Annotated[SomeStruct, Body(...)]`: Litestar reads it,
decodes it into the msgspec Struct and documents it in the OpenAPI document. Litestar runs a route's
guards, then its `before_request` hook, and only then resolves `data` (litestar/routes/http.py:
`authorize_connection`, then `_call_handler_function`), so the properties of the raw reads stay:

1. `keyed_body` (the route's `before_request` hook) opens the call and checks its key first: an
   anonymous or revoked key is refused with 401 before a byte of its body is read or decoded. The
   check runs before the core opens the request's trace span, so the hook notes when it ran
   (`Call.authenticated_ns`): the core starts the request's span there and, with
   `tracing.step_spans` on, records the check as the `authenticate` step, as on a route whose key
   the core checks itself. The check is a hook, not a Litestar guard: Litestar runs each guard with
   a fresh copy of the route handler (`copy(self)` in `authorize_connection`), which took 3-4 % of
   py-spy's samples on bench_policy_proxy's proxied chat path under wrk at c=16; the hook runs at the same point
   (after routing, before `data` is resolved) with the same refusals. Operators' routes keep their
   guard (`gateway.admin.guard.ADMIN_GUARD`): they are not on the request path.
2. Then the same hook (or `read_within_deadline` alone, on routes keyed otherwise) refuses a body
   declared as anything but JSON (415), then reads it under the call's deadline
   (`server.request_timeout_s`: a body trickled in byte by byte gets a 504 instead of holding the
   connection forever) and under Litestar's `request_max_body_size` (413). Litestar keeps the bytes
   on the connection, and its decoding of `data` reads them from there.
3. Litestar decodes `data`; its refusals (bad JSON, a field of the wrong type, too large) are
   answered by `framework_refusal` in the caller's protocol envelope.

Litestar converts a body to the Struct in lax mode (msgspec `strict=False`): a number sent as a
string (`"max_tokens": "5"`) is accepted. That is the framework's documented behaviour, kept.
"""

from __future__ import annotations

import time
from typing import Any

from litestar import Request, Response
from litestar.connection import ASGIConnection
from litestar.exceptions import (
    HTTPException,
    InternalServerException,
    SerializationException,
    ValidationException,
)

from fleetgate.errors import GatewayError, Protocol
from gateway.core.calls import Call
from gateway.core.service import GatewayCore
from gateway.http.errors import error_response
from gateway.wire.credentials import bearer_key

#: content types a typed JSON body may declare ("": none declared)
JSON_TYPES = ("application/json", "")
#: where a request's Call lives on its connection state, from the key check to the handler
_CALL_KEY = "fleetgate_call"


def lower_headers(connection: ASGIConnection[Any, Any, Any, Any]) -> dict[str, str]:
    """The request's headers, names lower-cased (a repeated header keeps its last value).

    Read from the ASGI scope, whose names the server already lower-cases, rather than through
    Litestar's Headers object (built anew on each access).
    """
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in connection.scope["headers"]}


def protocol_of_path(path: str) -> Protocol:
    """The protocol envelope of a path no route claimed (404, 405) or whose route names none."""
    if path.startswith("/v2"):
        return "v2"
    if path.startswith("/v1/models/") and (":" in path or "/versions/" in path or "/labels/" in path):
        return "tfserving"
    if path.startswith("/v1"):
        return "openai"
    return "plain"


def call_of(connection: ASGIConnection[Any, Any, Any, Any]) -> Call:
    """The request's protocol-neutral call, opened on first use and kept on the connection's state
    (the body hook, the handler's `call` dependency and an error handler see one call).

    Kept in the ASGI scope's `state` dict (which Litestar creates for every request), not through
    `connection.state`: that property wraps the dict in a new `State`, with its own lock, on each
    access.
    """
    state = connection.scope["state"]
    call = state.get(_CALL_KEY)
    if call is None:
        handler = connection.scope.get("route_handler")
        # a route names its envelope in `opt` (none named: plain); a path no route claimed by its prefix
        protocol = handler.opt.get("protocol", "plain") if handler is not None else protocol_of_path(
            connection.scope["path"]
        )
        headers = lower_headers(connection)
        call = Call(protocol, headers, bearer_key(headers))
        state[_CALL_KEY] = call
    return call


def opened_call(connection: ASGIConnection[Any, Any, Any, Any]) -> Call | None:
    """The call the body hook or handler opened for this request, if any (error handlers)."""
    return connection.scope.get("state", {}).get(_CALL_KEY)


async def identify_caller(connection: ASGIConnection[Any, Any, Any, Any]) -> Call:
    """Check the caller's key before its body is read (a 401 costs no body read).

    The principal is kept on the call, so the core's identify step takes it instead of checking
    the key a second time (a second check would count the key's use twice); so is when the check
    ran, for the request's trace (the core opens its span later).
    """
    core: GatewayCore = connection.app.state.core
    call = call_of(connection)
    started = time.time_ns()
    call.principal = await core.identify(call)
    call.authenticated_ns = (started, time.time_ns())
    return call


async def keyed_body(request: Request[Any, Any, Any]) -> None:
    """`before_request` of the client routes with a JSON body: the key, then the body (see above)."""
    await identify_caller(request)
    await read_within_deadline(request)


async def read_within_deadline(request: Request[Any, Any, Any]) -> None:
    """`before_request`: read the body under the call's deadline (Litestar keeps it for `data`)."""
    core: GatewayCore = request.app.state.core
    call = call_of(request)
    # Litestar decodes any body as JSON; a client that says it sends something else is told so
    ctype = call.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in JSON_TYPES:
        raise GatewayError(
            415, "unsupported_media_type", f"content type {ctype!r} is not supported; send application/json"
        )
    try:
        async with core.deadline(call).scope():
            await request.body()
    except InternalServerException:  # Litestar's word for a client gone mid-body
        raise GatewayError(400, "client_disconnected", "the client closed the connection mid-body") from None


def _validation_message(exc: ValidationException) -> str:
    """msgspec's own words and where the bad value is: the JSON path of a body's field
    (`- at $.messages[0].role`, as the gateway's own decoders say it) or the parameter's name."""
    problems = exc.extra if isinstance(exc.extra, list) else []
    for problem in problems:
        if not isinstance(problem, dict):
            continue
        key = str(problem.get("key", ""))
        message = str(problem.get("message", ""))
        if problem.get("source") != "body":
            return f"invalid request: {message} - {problem.get('source', 'parameter')} parameter `{key}`"
        if key == "data" and message in ("'data'", "Object missing required field `data`"):
            return "invalid request: the request has no JSON body"  # Litestar had nothing to convert
        if key in ("", "data"):  # the body itself: a required field missing, or not an object
            return f"invalid request: {message}"
        return f"invalid request: {message} - at `$.{key}`"
    return f"invalid request: {exc.detail}"


def framework_refusal(request: Request[Any, Any, Any], exc: HTTPException) -> tuple[int, str, str]:
    """Litestar's refusal of a request as (status, code, message) for the caller's envelope."""
    status = exc.status_code
    if status == 404:
        return status, "not_found", "no such endpoint"
    if status == 405:
        return status, "method_not_allowed", str(exc.detail)
    if status == 413:
        limit = request.route_handler.resolve_request_max_body_size()
        return status, "body_too_large", f"request body exceeds {limit} bytes"
    if isinstance(exc, ValidationException):
        return status, "invalid_request", _validation_message(exc)
    if isinstance(exc.__cause__, SerializationException):  # Litestar's word for a body that is not JSON
        return status, "invalid_json", f"malformed JSON: {exc.detail}"
    return status, "http_error", str(exc.detail)


def refusal_response(request: Request[Any, Any, Any], exc: HTTPException) -> Response[bytes]:
    """Exception handler for Litestar's own refusals: the caller's envelope, and the access-log
    line of a call that the body hook had opened."""
    status, code, message = framework_refusal(request, exc)
    call = opened_call(request)
    if call is None:
        return error_response(protocol_of_path(request.url.path), status, code, message)
    call.done(status, code)
    response = error_response(call.protocol, status, code, message)
    response.headers["x-request-id"] = call.echo_id
    return response
