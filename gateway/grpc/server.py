"""The gateway's gRPC server: opened and closed by the app's lifespan, on the same event loop.

Services: `inference.GRPCInferenceService` (KServe v2 / Triton), TF Serving's `PredictionService` and
`ModelService` where `tensorflow-serving-api` is installed (TensorFlow imported by their first call,
gateway/grpc/tfserving_lazy.py), `grpc.health.v1.Health` (SERVING while the
gateway is ready, as `/v2/health/ready` answers) and server reflection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from backends.runtime.lazy import MissingRuntime, require
from gateway.config import Config
from gateway.core.service import GatewayCore
from gateway.grpc.ports import GrpcPortBusy, busy_message, check_port_free
from gateway.grpc.tfserving_lazy import add_lazy_tfserving

log = structlog.get_logger(__name__)

#: how often the health service's status follows the gateway's readiness (a drain shows within this)
HEALTH_REFRESH_S = 0.25


@dataclass
class GrpcFront:
    server: Any
    port: int
    services: list[str]
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def stop(self, grace_s: float) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.server.stop(grace_s)


def _ms(seconds: float) -> int:
    """Seconds as a channel argument's milliseconds (a C int: at most about 24 days)."""
    return max(1, min(int(seconds * 1000), 2**31 - 1))


def server_options(config: Config) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments (grpc core's public names, include/grpc/impl/channel_arg_names.h)."""
    s = config.server
    return [
        ("grpc.max_receive_message_length", s.max_body_bytes),
        ("grpc.max_send_message_length", s.max_body_bytes),
        # connections past the cap are closed as they are accepted, so idle sockets cannot take
        # every file descriptor the process (and its HTTP port) shares
        ("grpc.max_allowed_incoming_connections", s.grpc_max_connections),
        # a socket that never sends the HTTP/2 preface and SETTINGS is closed after this, as an
        # HTTP connection that never finishes its headers is (grpc's default is 120 s)
        ("grpc.server_handshake_timeout_ms", _ms(s.header_timeout_s)),
        # a connection with no call in flight this long gets GOAWAY; clients reconnect on their next call
        ("grpc.max_connection_idle_ms", _ms(s.grpc_idle_timeout_s)),
    ]


def check_grpc_port(config: Config) -> None:
    """Before serving: raise GrpcPortBusy (a ConfigError, one line) when the gRPC port is taken.

    Skipped when gRPC is off, on an ephemeral port, or `auto` without the gRPC extra installed
    (start_grpc then serves HTTP alone).
    """
    port = config.server.grpc_listen_port
    if not port:
        return
    if config.server.grpc_port == "auto":
        try:
            require("grpc.aio", extra="grpc")
        except MissingRuntime:
            return
    check_port_free(config.server.host, port)


async def start_grpc(config: Config, core: Callable[[], GatewayCore]) -> GrpcFront | None:
    """Start the gRPC server on `server.grpc_port`, or return None when it is off."""
    port = config.server.grpc_listen_port
    if port is None:
        return None
    try:
        aio = require("grpc.aio", extra="grpc")
        require("tritonclient.grpc.service_pb2", extra="grpc")
        require("grpc_health.v1.health", extra="grpc")
        require("grpc_reflection.v1alpha.reflection", extra="grpc")
    except MissingRuntime as exc:
        if config.server.grpc_port != "auto":
            raise  # asked for by port: refuse to start without it
        log.warning("grpc_front_off", reason=str(exc))  # the default: serve HTTP alone
        return None
    service_pb2 = require("tritonclient.grpc.service_pb2", extra="grpc")
    service_grpc = require("tritonclient.grpc.service_pb2_grpc", extra="grpc")
    model_config_pb2 = require("tritonclient.grpc.model_config_pb2", extra="grpc")
    health = require("grpc_health.v1.health", extra="grpc")
    health_pb2 = require("grpc_health.v1.health_pb2", extra="grpc")
    health_pb2_grpc = require("grpc_health.v1.health_pb2_grpc", extra="grpc")
    reflection = require("grpc_reflection.v1alpha.reflection", extra="grpc")
    from gateway.grpc.v2_service import InferenceService

    server = aio.server(
        options=server_options(config), maximum_concurrent_rpcs=config.server.grpc_max_concurrent_rpcs
    )
    service_grpc.add_GRPCInferenceServiceServicer_to_server(
        InferenceService(core, service_pb2, model_config_pb2), server
    )
    names = [service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name]
    names += add_lazy_tfserving(core, server)  # TensorFlow is imported by the first TF Serving call
    checker = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    names.append(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
    reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], server)
    try:
        bound = server.add_insecure_port(f"{config.server.host}:{port}")
    except RuntimeError:  # taken since check_grpc_port looked (grpc says only "failed to bind")
        bound = 0
    if bound == 0:
        raise GrpcPortBusy(busy_message(config.server.host, port))
    await server.start()
    front = GrpcFront(server, bound, names)
    front._tasks.append(asyncio.get_running_loop().create_task(_follow_readiness(core, checker, health_pb2)))
    log.info("grpc_started", port=bound, services=names)
    return front


async def _follow_readiness(core: Callable[[], GatewayCore], checker: Any, health_pb2: Any) -> None:
    """The health status ("" = the whole server) follows the gateway's readiness."""
    status = health_pb2.HealthCheckResponse
    last = None
    while True:
        ready = core().ready()
        if ready != last:
            value = status.SERVING if ready else status.NOT_SERVING
            await checker.set("", value)
            last = ready
        await asyncio.sleep(HEALTH_REFRESH_S)
