"""The routes that carry the traffic, answered ahead of the framework's router.

For every request Litestar matches a route, builds the handler's signature model, resolves its
dependencies (`core`, `call`) and calls it: about a tenth of the event loop's time on a one-row
tensor request at c=32 (py-spy, bench_tensor_peers' heavy MLP), and more on a proxied chat request.
The inference routes read their bodies and answer in their protocol's envelope themselves, so they
use none of that. Here their paths are matched by one regular expression each and the same handler
code runs with the same `core` and `call`; any other request, or one these patterns do not match
exactly (another method, a trailing slash), goes to Litestar as before.

`FLEETGATE_HOT_ROUTES=off` in the environment leaves them to Litestar (bench/bench_hot_routes.py
measures one against the other; a way to rule the fast path out when chasing a problem).

The routes stay registered with Litestar too: the OpenAPI description is built from them, and a
request the fast path passes on (a GET on an infer path: 405) is answered there as it always was.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Litestar, Request
from litestar._asgi.utils import is_valid_host  # the router's own Host check, not public API
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from gateway.calls import Call, ModelRef
from gateway.core import GatewayCore
from gateway.errors import Protocol
from gateway.http import http_failure, open_call
from gateway.protocols import kserve, openai, tfserving

#: set to "off" to leave every route to Litestar's router
SWITCH_ENV = "FLEETGATE_HOT_ROUTES"

#: what a hot route's handler is given: the request, the core, its call and the path's match
Handler = Callable[[Request, GatewayCore, Call, re.Match[str]], Awaitable[Any]]


async def _v2_infer(request: Request, core: GatewayCore, call: Call, found: re.Match[str]) -> Any:
    return await kserve.infer_model(request, core, call, ModelRef(found["model"], found["version"]))


async def _chat(request: Request, core: GatewayCore, call: Call, found: re.Match[str]) -> Any:
    return await openai.generate_route(request, core, call, chat=True)


async def _completions(request: Request, core: GatewayCore, call: Call, found: re.Match[str]) -> Any:
    return await openai.generate_route(request, core, call, chat=False)


#: TF Serving's path word -> the slot the last segment's name fills
_TFS_SLOTS = {None: "model", "versions": "version", "labels": "label"}


async def _tfs_predict(request: Request, core: GatewayCore, call: Call, found: re.Match[str]) -> Any:
    model, slot = found["model"] or "", _TFS_SLOTS[found["slot"]]
    return await tfserving.predict_route(request, core, call, model, found["segment"], slot)


#: POST path pattern -> (protocol of its envelope, handler); a segment is what Litestar's `{x:str}` takes
_ROUTES: list[tuple[re.Pattern[str], Protocol, Handler]] = [
    (re.compile(r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer"), "v2", _v2_infer),
    (re.compile(r"/v1/chat/completions"), "openai", _chat),
    (re.compile(r"/v1/completions"), "openai", _completions),
    # TF Serving REST: POST /v1/models/NAME:predict, .../NAME/versions/V:predict, .../NAME/labels/L:predict
    (
        re.compile(r"/v1/models/(?:(?P<model>[^/]+)/(?P<slot>versions|labels)/)?(?P<segment>[^/]+)"),
        "tfserving",
        _tfs_predict,
    ),
]


def _host_is_valid(scope: Scope) -> bool:
    """Litestar's router refuses a malformed Host header with a 400; such requests are left to it."""
    host = next((value for name, value in scope["headers"] if name == b"host"), None)
    return host is None or is_valid_host(host)


class HotRoutes:
    """The app's ASGI handler: hot POST routes answered directly, the rest by `inner` (Litestar's)."""

    __slots__ = ("_app", "_inner")

    def __init__(self, app: Litestar, inner: ASGIApp) -> None:
        self._app = app
        self._inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            for pattern, protocol, handler in _ROUTES:
                found = pattern.fullmatch(path)
                if found is not None:
                    if _host_is_valid(scope):
                        await self._answer(scope, receive, send, protocol, handler, found)
                        return
                    break  # the router answers it (400)
        await self._inner(scope, receive, send)

    async def _answer(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        protocol: Protocol,
        handler: Handler,
        found: re.Match[str],
    ) -> None:
        started = False

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        request: Request = Request(scope, receive, send)
        call = open_call(request, protocol)
        try:
            await self._respond(request, call, handler, found, tracked_send)
        except Exception as exc:
            # the handlers answer their own errors; this is what Litestar's exception middleware
            # does for the rest: an answer in the protocol's envelope while nothing was sent yet
            if started:
                raise
            await self._asgi(http_failure(call, exc), request)(scope, receive, send)

    async def _respond(
        self, request: Request, call: Call, handler: Handler, found: re.Match[str], send: Send
    ) -> None:
        response = await handler(request, self._app.state.core, call, found)
        await self._asgi(response, request)(request.scope, request.receive, send)

    @staticmethod
    def _asgi(response: Any, request: Request) -> ASGIApp:
        """A handler's answer as an ASGI app: a Litestar `Response` (errors, JSON answers, streams)
        is converted as Litestar's own handlers convert it; a `RawResponse` already is one."""
        if hasattr(response, "to_asgi_response"):
            return response.to_asgi_response(None, request)
        return response


def install(app: Litestar) -> Litestar:
    """Put the hot routes in front of `app`'s router (inside `Litestar.__call__`, so `app.state`, the
    lifespan and everything reading the app object are unchanged).

    The fast path runs none of Litestar's middleware, guards or request hooks: the app has none
    today, and this refuses to install over any, so adding one cannot be skipped silently.
    """
    extras = {
        "middleware": app.middleware,
        "cors_config": app.cors_config,
        "allowed_hosts": app.allowed_hosts,
        "compression_config": app.compression_config,
        "before_request": app.before_request,
        "after_request": app.after_request,
        "after_response": app.after_response,
        "guards": app.guards,
    }
    present = sorted(name for name, value in extras.items() if value)
    if present:
        raise RuntimeError(
            f"the hot routes would bypass the app's {', '.join(present)}: see gateway/hot_routes.py"
        )
    app.asgi_handler = HotRoutes(app, app.asgi_handler)
    return app


def enabled(value: str | None) -> bool:
    """Whether `FLEETGATE_HOT_ROUTES` leaves the fast path on (unset: on; off, 0, false, no: off)."""
    return (value or "on").strip().lower() not in {"off", "0", "false", "no"}
