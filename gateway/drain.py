"""Graceful drain on SIGTERM, for load balancers and Kubernetes rollouts.

1. SIGTERM: readiness turns not-ready at once (`/health/ready`, `/v2/health/ready` answer 503, gRPC
   health NOT_SERVING), but every request is still served for `server.drain_grace_s`, the time a load
   balancer needs to notice and stop sending.
2. After the grace: new requests are refused with 503 and `Retry-After` (also on kept-alive
   connections), the listeners close, and requests in flight and open streams run to their end for
   up to `server.drain_timeout_s`. What still runs then is cancelled: its reservation is released
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
import time
from types import FrameType
from typing import Any

import structlog
import uvicorn

log = structlog.get_logger(__name__)


#: what the supervisor of `server.workers > 1` sends its workers to start their drain (SIGTERM
#: to a worker may come from the process group's kill as well; see gateway/supervisor.py)
DRAIN_SIGNAL = signal.SIGUSR1


class DrainState:
    """Where the process is in its drain; the core reads it (readiness, refusing new calls)."""

    def __init__(self) -> None:
        self.draining = False
        self.refusing = False
        self.started_at: float | None = None

    def begin(self) -> None:
        self.draining = True
        self.started_at = time.monotonic()

    def refuse_new(self) -> None:
        self.refusing = True


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain above: the one process of `server.workers: 1`, and each worker
    process of `server.workers: N` (gateway/supervisor.py), whose app is built inside it, so its
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
        if self.drain is None:
            self.drain = _drain_state_of(self.config.loaded_app)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in uvicorn's captured signals: it would re-raise SIGTERM after the shutdown,
        # and the process would end killed by it instead of exiting 0.
        drain = self.drain  # None: a signal before the app started, nothing to drain yet
        if sig == signal.SIGTERM and drain is not None and drain.draining and not self.repeat_sigterm_forces:
            return
        if drain is None or drain.draining or self.should_exit or sig != signal.SIGTERM or self._loop is None:
            if (drain is not None and drain.draining) or self.should_exit:
                log.warning("drain_forced", signal=signal.Signals(sig).name, pid=os.getpid())
                self.force_exit = True
            if drain is not None:
                drain.begin()
                drain.refuse_new()
            self.should_exit = True
            return
        log.info(
            "drain_started", grace_s=self.grace_s, timeout_s=self.config.timeout_graceful_shutdown, pid=os.getpid()
        )
        self.drain.begin()
        self._loop.call_soon_threadsafe(self._loop.call_later, self.grace_s, self._after_grace)

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
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
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


def _drain_state_of(app: Any) -> DrainState | None:
    """The gateway app's drain state, under whatever ASGI middleware uvicorn wrapped it in."""
    for _ in range(8):
        state = getattr(getattr(app, "state", None), "drain", None)
        if isinstance(state, DrainState):
            return state
        app = getattr(app, "app", None)
        if app is None:
            break
    return None
