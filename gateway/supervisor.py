"""`server.workers: N`: the parent process that binds the port once and runs N draining workers.

uvicorn's own supervisor starts workers whose servers end at once on SIGTERM; this one starts each
worker as a `DrainingServer` (gateway/drain.py), so a worker drains exactly like a lone gateway:
not-ready at once, still serving for the grace, then refusing new work while what runs finishes.

Signals to the parent: SIGTERM is passed to every worker (they drain) and the parent waits for
them, up to the grace plus the drain timeout plus a margin, then kills what is left. A second
SIGTERM, or SIGINT, is passed on too: the workers end at once (still flushing usage). A worker that
dies while the gateway serves is replaced; one that fails during its start-up stops the gateway
(the same config would fail the same way in every replacement).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import threading
import time
from multiprocessing.context import SpawnProcess
from types import FrameType

import structlog
import uvicorn
from uvicorn._subprocess import get_subprocess
from uvicorn.config import STARTUP_FAILURE

from gateway.drain import DrainingServer
from gateway.workers import METRICS_DIR_ENV

log = structlog.get_logger(__name__)

#: seconds the parent waits beyond the workers' own drain before killing them
_KILL_MARGIN_S = 10.0
_POLL_S = 0.25


def run_worker(config: uvicorn.Config, grace_s: float, sockets: list[socket.socket]) -> None:
    """A worker process's body (spawned, so module level): one draining server on the shared socket."""
    DrainingServer(config, None, grace_s).run(sockets=sockets)


class DrainingSupervisor:
    """Starts `workers` draining workers on one bound socket and keeps them until told to stop."""

    def __init__(self, config: uvicorn.Config, workers: int, grace_s: float, drain_timeout_s: float) -> None:
        self.config = config
        self.workers = workers
        self.grace_s = grace_s
        self.stop_wait_s = grace_s + drain_timeout_s + _KILL_MARGIN_S
        self._signals: list[int] = []
        self._wake = threading.Event()
        self._processes: list[SpawnProcess] = []

    def run(self) -> int:
        """Serve until a signal; the exit status: 0 when every worker ended cleanly."""
        sock = self.config.bind_socket()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._processes = [self._spawn(sock) for _ in range(self.workers)]
        log.info("workers_started", workers=self.workers, pids=[p.pid for p in self._processes])
        while not self._signals:
            self._wake.wait(_POLL_S)
            if not self._signals and not self._replace_dead(sock):
                self._signals.append(signal.SIGINT)  # a worker cannot start: stop the rest at once
        status = self._stop()
        sock.close()
        return status

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signals.append(sig)
        self._wake.set()
        if len(self._signals) > 1 or sig != signal.SIGTERM:
            self._pass_on(sig)  # while stopping: the workers end at once

    def _spawn(self, sock: socket.socket) -> SpawnProcess:
        process = get_subprocess(self.config, functools.partial(run_worker, self.config, self.grace_s), [sock])
        process.start()
        return process

    def _replace_dead(self, sock: socket.socket) -> bool:
        """Replace workers that died; False when one failed while starting (nothing to retry)."""
        for index, process in enumerate(self._processes):
            if process.is_alive():
                continue
            if process.exitcode == STARTUP_FAILURE:
                log.error("worker_failed_to_start", pid=process.pid)
                return False
            log.warning("worker_died", pid=process.pid, exitcode=process.exitcode)
            _forget_metrics_of(process)
            self._processes[index] = self._spawn(sock)
        return True

    def _pass_on(self, sig: int) -> None:
        for process in self._processes:
            if process.is_alive() and process.pid is not None:
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:  # ended meanwhile
                    pass

    def _stop(self) -> int:
        first = self._signals[0]
        log.info("workers_stopping", signal=signal.Signals(first).name, wait_s=self.stop_wait_s)
        self._pass_on(first)
        deadline = time.monotonic() + self.stop_wait_s
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
        left = [p for p in self._processes if p.is_alive()]
        for process in left:
            log.error("worker_killed", pid=process.pid)
            process.kill()
            process.join()
        for process in self._processes:
            _forget_metrics_of(process)
        codes = [p.exitcode for p in self._processes]
        log.info("workers_stopped", exitcodes=codes, killed=len(left))
        # -SIGTERM: a worker still booting (before its server took over the signal) served nothing
        clean = (0, -signal.SIGTERM, -signal.SIGINT)
        return 0 if not left and all(code in clean for code in codes) else 1


def _forget_metrics_of(process: SpawnProcess) -> None:
    """Drop a dead worker's live gauges from the shared metrics (its counters stay in the sums)."""
    if process.pid is not None and os.environ.get(METRICS_DIR_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(process.pid)
