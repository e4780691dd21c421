"""Graceful drain on SIGTERM, for load balancers and Kubernetes rollouts.

1. SIGTERM: readiness turns not-ready at once (`/health/ready`, `/v2/health/ready` answer 503, gRPC
   health NOT_SERVING), but every request is still served for `server.drain_grace_s`, the time a load
   balancer needs to notice and stop sending.
2. After the grace: new requests are refused with 503 and `Retry-After` (also on kept-alive
   connections), the listeners close, and requests in flight and open streams run to their end for
   up to `server.drain_timeout_s`. Every connection accepted before the listener closed gets an
   answer (the kernel's backlog is taken first; an idle kept-alive connection may still send one
   request, answered with `Connection: close`, gateway/serve/http_protocol.py); only later ones are refused. What still runs then is cancelled: its reservation is released
   and it is charged nothing (a stream is charged what it delivered).
3. The app's shutdown closes the gRPC server, the deployments and the state store (every pending
   usage write is committed), and the process exits 0.

A second SIGTERM or SIGINT ends at once: running requests are cancelled (their reservations
released), and usage is still flushed by the same shutdown.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import structlog
import uvicorn

from gateway.core.drain_state import DrainState
from gateway.serve.listener_close import HANDSHAKE_SETTLE_S, duplicate, stop_new_handshakes, take_backlog

log = structlog.get_logger(__name__)


#: what the supervisor of `server.workers > 1` sends its workers to start their drain (SIGTERM
#: to a worker may come from the process group's kill as well; see gateway/serve/supervisor.py)
DRAIN_SIGNAL = signal.SIGUSR1




class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain above: the one process of `server.workers: 1`, and each worker
    process of `server.workers: N` (gateway/serve/supervisor.py), whose app is built inside it, so its
    drain state is found once the app has started (`state=None`)."""

    def __init__(
        self, config: uvicorn.Config, state: DrainState | None, grace_s: float, repeat_sigterm_forces: bool = True
    ) -> None:
        super().__init__(config)
        self.drain = state
        self.grace_s = grace_s
        #: False in a worker: a SIGTERM during its drain is the process group's copy of the one that
        #: started it, not a second request (the supervisor forces with SIGINT)
        self.repeat_sigterm_forces = repeat_sigterm_forces
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        previous = signal.signal(DRAIN_SIGNAL, self._on_drain_signal)
        try:
            await super().serve(sockets)
        finally:
            signal.signal(DRAIN_SIGNAL, previous)

    def _on_drain_signal(self, sig: int, frame: FrameType | None) -> None:
        """The supervisor's "drain": a first SIGTERM's drain, and nothing more when one runs already
        (a SIGTERM sent to the whole process group reaches the workers directly too)."""
        if self.drain is not None and self.drain.draining:
            return
        self.handle_exit(signal.SIGTERM, frame)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        app = _gateway_app(self.config.loaded_app)
        if self.drain is None and app is not None:
            self.drain = getattr(app.state, "drain", None)
        if self.started:
            log.info("gateway_listening", pid=os.getpid(), **_addresses(self.servers, app))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler: it runs between two bytecodes of whatever the main thread was doing,
        # perhaps inside the log stream's lock (structlog's is not reentrant) while writing a
        # request's line. So it only sets flags; what logs or arms a timer runs on the loop.
        # Not recorded in uvicorn's captured signals: it would re-raise SIGTERM after the shutdown,
        # and the process would end killed by it instead of exiting 0.
        drain = self.drain  # None: a signal before the app started, nothing to drain yet
        if sig == signal.SIGTERM and drain is not None and drain.draining and not self.repeat_sigterm_forces:
            return
        if drain is None or drain.draining or self.should_exit or sig != signal.SIGTERM or self._loop is None:
            if (drain is not None and drain.draining) or self.should_exit:
                self.force_exit = True
                self._on_loop(self._log_forced, sig)
            if drain is not None:
                drain.begin()
                drain.refuse_new()
            self.should_exit = True
            return
        drain.begin()
        self._on_loop(self._start_grace)

    def _on_loop(self, callback: Callable[..., None], *args: Any) -> None:
        """Run `callback` on the server's loop soon (safe from a signal handler)."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop has closed: the process is ending anyway
            pass

    def _log_forced(self, sig: int) -> None:
        log.warning("drain_forced", signal=signal.Signals(sig).name, pid=os.getpid())

    def _start_grace(self) -> None:
        log.info(
            "drain_started", grace_s=self.grace_s, timeout_s=self.config.timeout_graceful_shutdown, pid=os.getpid()
        )
        asyncio.get_running_loop().call_later(self.grace_s, self._after_grace)

    def _after_grace(self) -> None:
        if self.should_exit or self.drain is None:
            return
        log.info("drain_refusing_new_requests")
        self.drain.refuse_new()
        self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        """uvicorn's shutdown, except that requests still running at the timeout (or at a forced
        exit) are cancelled and awaited before the app's shutdown: their cleanup releases their
        reservations while the state store is still open, and the app's shutdown always runs."""
        accepted = await self._close_listeners(sockets)
        loop = asyncio.get_running_loop()
        for sock in accepted:  # answered like every other connection (503 + Connection: close)
            try:
                await loop.connect_accepted_socket(self._protocol, sock)
            except OSError:  # the client gave up meanwhile
                sock.close()
        # each connection ends without cutting a request on its way (gateway/serve/http_protocol.py)
        for connection in list(self.server_state.connections):
            connection.shutdown()
        await asyncio.sleep(0.1)
        try:
            await asyncio.wait_for(
                self._wait_tasks_to_complete(), timeout=self.config.timeout_graceful_shutdown
            )
        except TimeoutError:
            log.warning("drain_timeout_cancelling", running=len(self.server_state.tasks))
        tasks = list(self.server_state.tasks)
        for task in tasks:
            task.cancel(msg="the gateway is shutting down")
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.lifespan.shutdown()

    async def _close_listeners(self, sockets: Any) -> list[socket.socket]:
        """Stop listening; returns the connections the kernel had accepted that the server had not
        taken yet. Closing a listener resets those, though their clients may have sent a request
        already: new handshakes are stopped first, and what is queued is taken before the close
        (gateway/serve/listener_close.py), so only connections attempted after that are refused."""
        listeners = [dup for server in self.servers for sock in server.sockets if (dup := duplicate(sock))]
        # only on a listener of this process's own: a worker's is shared with the others
        # (`server.workers > 1`), which may still be serving (a worker restarted, or one ahead)
        own = sockets is None
        if own and [listener for listener in listeners if stop_new_handshakes(listener)]:
            await asyncio.sleep(HANDSHAKE_SETTLE_S)  # the server takes the handshakes under way
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        return take_backlog(listeners)

    def _protocol(self) -> asyncio.Protocol:
        """A connection's protocol, made as uvicorn makes it for the connections it accepts."""
        return self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config, server_state=self.server_state, app_state=self.lifespan.state
        )


def _gateway_app(app: Any) -> Any:
    """The gateway app (the one with a drain state), under whatever ASGI middleware uvicorn wrapped
    it in; None for another app."""
    for _ in range(8):
        if isinstance(getattr(getattr(app, "state", None), "drain", None), DrainState):
            return app
        app = getattr(app, "app", None)
        if app is None:
            break
    return None


def _addresses(servers: list[Any], app: Any) -> dict[str, str | None]:
    """Where this process listens: HTTP, gRPC and the health port (None: off)."""
    sockname = servers[0].sockets[0].getsockname() if servers and servers[0].sockets else None
    state = getattr(app, "state", None)
    grpc = getattr(state, "grpc", None)
    health = getattr(state, "health_listener", None)
    host = sockname[0] if sockname else "?"
    return {
        "http": _url("http", sockname[0], sockname[1]) if sockname else None,
        "grpc": f"{_host(host)}:{grpc.port}" if grpc is not None else None,
        "health": _url("http", *health.address) if health is not None else None,
    }


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://{_host(host)}:{port}"
