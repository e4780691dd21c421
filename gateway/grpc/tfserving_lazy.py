"""TF Serving's gRPC services, registered at start without importing TensorFlow.

TF Serving's generated stubs import TensorFlow's protos, which import TensorFlow itself: about 10 s
of a loaded machine's start, and a couple of GB of memory, for a port most deployments never call
with TF Serving's API. Here the two services are registered by name with a generic handler that
passes bytes: the first call to either imports `gateway.grpc.tfserving_service` in a worker thread
(the event loop keeps serving meanwhile), and every call is then decoded, served and encoded by the
generated handlers of that module, exactly as if they had been registered at start.

Whether TF Serving can be served at all is checked at start without importing it (the package is
installed or not), so a gateway without `tensorflow-serving-api` lists no TF Serving service, as before.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Callable
from typing import Any

import grpc
import structlog

from gateway.core.service import GatewayCore

log = structlog.get_logger(__name__)

SERVICES = ("tensorflow.serving.PredictionService", "tensorflow.serving.ModelService")


def tfserving_installed() -> bool:
    """Whether TF Serving's generated stubs are installed (looked up, not imported)."""
    try:
        return importlib.util.find_spec("tensorflow_serving.apis") is not None
    except ModuleNotFoundError:
        return False


class _Captured:
    """Stands in for the server when the generated `add_*Servicer_to_server` functions register
    their handlers, and keeps them (grpc's public `GenericRpcHandler` shape)."""

    def __init__(self) -> None:
        self.handlers: list[Any] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.handlers.extend(handlers)

    def method(self, name: str) -> Any:
        """The generated handler of a full method name (`/package.Service/Method`), or None."""
        details = _Details(name)
        return next((h for g in self.handlers if (h := g.service(details)) is not None), None)


class _Details:
    """The one field of `grpc.HandlerCallDetails` the generated handlers read."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.invocation_metadata = ()


def _generated_handlers(core: Callable[[], GatewayCore]) -> _Captured:
    """Import TF Serving's servicers (seconds) and return their generated handlers."""
    from gateway.grpc.tfserving_service import add_tfserving_services

    captured = _Captured()
    add_tfserving_services(core, captured)
    return captured


class LazyTfServing(grpc.GenericRpcHandler):
    """TF Serving's services, imported on their first call."""

    def __init__(self, core: Callable[[], GatewayCore]) -> None:
        self._core = core
        self._methods: _Captured | None = None
        self._loading: asyncio.Lock | None = None

    def service(self, handler_call_details: Any) -> Any:
        method = handler_call_details.method
        if not method.startswith(tuple(f"/{s}/" for s in SERVICES)):
            return None
        if self._methods is not None:
            return self._methods.method(method)  # loaded: the generated handler itself (None: UNIMPLEMENTED)

        async def call(raw: bytes, context: Any) -> bytes:
            handler = (await self._load()).method(method)
            if handler is None:
                await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"method {method} is not served")
            request = handler.request_deserializer(raw)
            return handler.response_serializer(await handler.unary_unary(request, context))

        # bytes in and out: the messages' classes come with the import this defers
        return grpc.unary_unary_rpc_method_handler(call)

    async def _load(self) -> _Captured:
        if self._methods is None:
            if self._loading is None:
                self._loading = asyncio.Lock()
            async with self._loading:
                if self._methods is None:
                    log.info("grpc_tfserving_loading")
                    self._methods = await asyncio.to_thread(_generated_handlers, self._core)
        return self._methods


def add_lazy_tfserving(core: Callable[[], GatewayCore], server: Any) -> list[str]:
    """Register TF Serving's services, imported on first call; their names (none when the package is
    not installed)."""
    if not tfserving_installed():
        log.warning("grpc_tfserving_unavailable", reason="tensorflow-serving-api is not installed")
        return []
    server.add_generic_rpc_handlers((LazyTfServing(core),))
    return list(SERVICES)
