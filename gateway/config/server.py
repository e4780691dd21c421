"""The `server:` section: listening ports, connection caps, timeouts, drain and the gRPC front door."""

from __future__ import annotations

import math
from typing import Literal

from backends.spec import SpecBase


class ServerConfig(SpecBase):
    #: address the HTTP port (and the gRPC port) listens on; `0.0.0.0` for every interface
    host: str = "127.0.0.1"
    #: the HTTP port (`fleetgate serve --port` overrides it); 0 picks a free one
    port: int = 8000
    #: largest request body (and gRPC message) accepted; a larger one is refused with 413
    max_body_bytes: int = 16 * 1024 * 1024
    #: a request not finished this long after it arrived is answered 504 (end-to-end deadline)
    request_timeout_s: float = 120.0
    #: the least severe log lines written (JSON lines on stdout)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: when /health/ready and /v2/health/ready answer 200: `any` deployment can serve (the default:
    #: one broken upstream must not take the whole gateway out of a load balancer), or `all` are loaded
    readiness: Literal["any", "all"] = "any"
    #: gateway processes on this port (see gateway/serve/workers.py); > 1 needs a shared (sqlite/redis) state
    workers: int = 1
    #: open connections beyond this get 503 at once (a flood of idle or slow clients cannot pile up)
    max_connections: int = 2048
    #: after SIGTERM, connections still open after this long are closed (slow clients included);
    #: the drain timeout unless `drain_timeout_s` is set
    graceful_shutdown_s: float = 30.0
    #: after SIGTERM, requests keep being served this long while readiness already says 503 (load
    #: balancers need time to notice); then new requests get 503 + Retry-After (gateway/serve/drain.py)
    drain_grace_s: float = 5.0
    #: after the grace, requests in flight and open streams may run this long before they are
    #: cancelled (their reservations released); default: `graceful_shutdown_s`
    drain_timeout_s: float | None = None
    #: a connection whose request headers are not all in after this long is closed (httptools server;
    #: on the gRPC port: a connection that has not sent its HTTP/2 preface and SETTINGS)
    header_timeout_s: float = 10.0
    #: a new connection that has sent no byte after this long is closed, so sockets opened and left
    #: silent cannot hold `max_connections` (httptools server; per connection, from its opening)
    first_byte_timeout_s: float = 5.0
    #: open connections one client address may hold in each gateway process (an IPv6 /64 counts as
    #: one address; `trusted_proxies` are not capped); beyond, a new one gets 503 and is closed
    max_connections_per_client: int = 256
    #: a second port answering only /health/live, /health/ready and /v2/health/{live,ready}, on
    #: `host`, outside every connection cap (a flood of the main port cannot fail the probes); point
    #: Kubernetes probes here and keep it off the public network. null (the default): off
    health_port: int | None = None
    #: reverse proxies (addresses or CIDR networks, `*` for any) whose X-Forwarded-For and
    #: X-Forwarded-Proto are believed: the client address (admin lockout, logs) is the one they
    #: name. Empty (the default): forwarded headers are ignored and the peer is the client
    trusted_proxies: tuple[str, ...] = ()
    #: the gRPC front door (KServe v2 / Triton and TF Serving services, health, reflection) on the
    #: same host; null turns it off; `auto` (the default) is `port + 1` (8001 beside 8000, and it
    #: moves with `--port`). Omitted: `FLEETGATE_GRPC_PORT` when set (a number, or `off`).
    #: Messages may be as large as `max_body_bytes`.
    grpc_port: int | Literal["auto"] | None = "auto"
    #: open gRPC connections beyond this are closed as they are accepted (one HTTP/2 connection
    #: carries many calls, so a client needs few); a connection that has not sent its HTTP/2
    #: preface within `header_timeout_s` is closed too, so idle sockets cannot hold the slots
    grpc_max_connections: int = 1024
    #: a gRPC connection with no call in flight for this long is closed (GOAWAY; clients reconnect)
    grpc_idle_timeout_s: float = 300.0
    #: gRPC calls in progress at once; one more is answered RESOURCE_EXHAUSTED at once
    grpc_max_concurrent_rpcs: int = 2048

    @property
    def grpc_listen_port(self) -> int | None:
        """The gRPC port to bind (`auto`: the HTTP port + 1), or None when gRPC is off."""
        if self.grpc_port == "auto":
            return self.port + 1 if 0 < self.port < 65535 else 0
        return self.grpc_port

    @property
    def shutdown_timeout_s(self) -> float:
        """How long requests in flight may run after SIGTERM's grace (drain timeout)."""
        return self.graceful_shutdown_s if self.drain_timeout_s is None else self.drain_timeout_s

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in 0..65535")
        if isinstance(self.grpc_port, int) and not 0 <= self.grpc_port <= 65535:
            raise ValueError("grpc_port must be in 0..65535, auto, or null")
        if self.port != 0 and self.grpc_port not in (None, 0) and self.grpc_listen_port == self.port:
            raise ValueError("grpc_port must differ from port")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if not 1 <= self.workers <= 256:
            raise ValueError("workers must be in 1..256")
        for name in ("max_connections", "grpc_max_connections", "grpc_max_concurrent_rpcs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        # durations: finite, and > 0 where zero would mean "never wait at all"
        for name, minimum_excluded in (
            ("request_timeout_s", True),
            ("graceful_shutdown_s", False),
            ("drain_grace_s", False),
            ("drain_timeout_s", False),
            ("header_timeout_s", True),
            ("grpc_idle_timeout_s", True),
        ):
            value = getattr(self, name)
            if value is None:  # drain_timeout_s: unset means graceful_shutdown_s
                continue
            if not math.isfinite(value) or value < 0 or (minimum_excluded and value == 0):
                raise ValueError(f"{name} must be a finite number {'>' if minimum_excluded else '>='} 0")
        self._check_front_door()

    def _check_front_door(self) -> None:
        """The main port's connection limits, the health port and the trusted proxies."""
        if not (math.isfinite(self.first_byte_timeout_s) and self.first_byte_timeout_s > 0):
            raise ValueError("first_byte_timeout_s must be a finite number > 0")
        if self.max_connections_per_client < 1:
            raise ValueError("max_connections_per_client must be >= 1")
        self._check_health_port()
        self._check_trusted_proxies()

    def _check_health_port(self) -> None:
        if self.health_port is None:
            return
        if not 0 <= self.health_port <= 65535:
            raise ValueError("health_port must be in 0..65535, or null")
        if self.health_port != 0 and self.health_port in (self.port, self.grpc_listen_port):
            raise ValueError("health_port must differ from port and grpc_port")

    def _check_trusted_proxies(self) -> None:
        import ipaddress

        for proxy in self.trusted_proxies:
            if proxy == "*":
                continue
            try:
                ipaddress.ip_network(proxy)
            except ValueError:
                raise ValueError(
                    f"trusted_proxies: {proxy!r} is not an address or a network (10.0.0.0/8, ::1, *)"
                ) from None
