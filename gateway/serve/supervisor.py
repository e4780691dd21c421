"""`server.workers: N`: the parent process that binds the port once and runs N draining workers.

uvicorn's own supervisor starts workers whose servers end at once on SIGTERM; this one starts each
worker as a `DrainingServer` (gateway/serve/drain.py), so a worker drains exactly like a lone gateway:
not-ready at once, still serving for the grace, then refusing new work while what runs finishes.

Signals to the parent:
- SIGTERM: every worker is told to drain with SIGUSR1 (`DRAIN_SIGNAL`), not SIGTERM, so a SIGTERM
  that also reached the workers directly (systemd's control-group kill, `kill -- -PGID`, `tini -g`)
  is not taken as a second one. The parent closes its copy of the listening socket (once the workers
  close theirs, new connections are refused at once) and waits up to the grace plus the drain timeout
  plus a margin, then kills what is left.
- A second SIGTERM, or SIGINT: passed on as SIGINT; the workers end at once (still flushing usage).
- SIGHUP: passed on; each worker reloads its config in place (gateway/admin/reload.py).

Workers: one that dies while the gateway serves is replaced, after a pause that doubles with each
death soon after a start (1 s up to 30 s); when `_MAX_QUICK_DEATHS` starts in a row die within
`_QUICK_DEATH_S`, the gateway drains the others and stops (the config or the machine is broken, and
respawning would spin). A worker whose parent disappears (killed, OOM) drains and exits on its own.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from multiprocessing.connection import wait as wait_for_any
from multiprocessing.context import SpawnProcess
from types import FrameType

import structlog
import uvicorn

from gateway.observe.multiprocess import METRICS_DIR_ENV
from gateway.serve.drain import DRAIN_SIGNAL, DrainingServer

log = structlog.get_logger(__name__)

#: seconds the parent waits beyond the workers' own drain before killing them
_KILL_MARGIN_S = 10.0
_POLL_S = 0.25
#: a worker that dies this soon after its start counts towards giving up
_QUICK_DEATH_S = 120.0
_MAX_QUICK_DEATHS = 5
_MAX_BACKOFF_S = 30.0


def run_worker(config: uvicorn.Config, grace_s: float, sockets: list[socket.socket]) -> None:
    """A worker process's body (spawned, so module level): one draining server on the shared socket.

    uvicorn's config is set up here as in any uvicorn process (its logging); the app is imported
    by path in this process (`config.app` is a string: `create_worker_app`).
    """
    config.configure_logging()
    parent = multiprocessing.parent_process()
    if parent is not None:
        threading.Thread(target=_drain_when_orphaned, args=(parent.sentinel,), daemon=True).start()
    DrainingServer(config, None, grace_s, repeat_sigterm_forces=False).run(sockets=sockets)


def _drain_when_orphaned(parent_sentinel: int) -> None:
    """Wait for the parent to end; if it ends first (killed), drain this worker instead of serving
    on without a supervisor."""
    wait_for_any([parent_sentinel])
    os.kill(os.getpid(), DRAIN_SIGNAL)


class _Worker:
    """One worker process and when it started."""

    def __init__(self, process: SpawnProcess) -> None:
        self.process = process
        self.started_at = time.monotonic()


class DrainingSupervisor:
    """Starts `workers` draining workers on one bound socket and keeps them until told to stop."""

    def __init__(self, config: uvicorn.Config, workers: int, grace_s: float, drain_timeout_s: float) -> None:
        self.config = config
        self.workers = workers
        self.grace_s = grace_s
        self.stop_wait_s = grace_s + drain_timeout_s + _KILL_MARGIN_S
        self._stop_signals: list[int] = []
        # wakes the main loop from a signal handler: a byte down a pipe (a threading.Event's lock
        # could be held by the very code the handler interrupted)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._workers: list[_Worker] = []
        self._quick_deaths = 0
        self._respawn_at = 0.0

    def run(self) -> int:
        """Serve until a stop signal; the exit status: 0 when every worker ended cleanly."""
        sock = self.config.bind_socket()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        self._workers = [self._spawn(sock) for _ in range(self.workers)]
        log.info("workers_started", workers=self.workers, pids=[w.process.pid for w in self._workers])
        while not self._stop_signals:
            if wait_for_any([self._wake_r], _POLL_S):
                os.read(self._wake_r, 64)
            if not self._stop_signals and not self._replace_dead(sock):
                log.error("workers_keep_dying", deaths=self._quick_deaths)
                self._stop_signals.append(signal.SIGTERM)  # drain the ones still serving, then stop
        return self._stop(sock)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGHUP:
            self._pass_on(signal.SIGHUP)
            return
        self._stop_signals.append(sig)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full of earlier wakes: the loop is woken already
            pass
        if len(self._stop_signals) > 1 or sig != signal.SIGTERM:
            self._pass_on(signal.SIGINT)  # while stopping, or SIGINT: the workers end at once

    def _spawn(self, sock: socket.socket) -> _Worker:
        # spawned (never forked: the parent may hold threads and loaded runtimes); the bound socket
        # is passed to the child, which accepts on it
        spawn = multiprocessing.get_context("spawn")
        process = spawn.Process(target=run_worker, args=(self.config, self.grace_s, [sock]))
        process.start()
        return _Worker(process)

    def _replace_dead(self, sock: socket.socket) -> bool:
        """Replace workers that died (after the backoff); False when they keep dying at start."""
        now = time.monotonic()
        for index, worker in enumerate(self._workers):
            process = worker.process
            if process.is_alive():
                continue
            if now < self._respawn_at:
                continue
            quick = now - worker.started_at < _QUICK_DEATH_S
            self._quick_deaths = self._quick_deaths + 1 if quick else 0
            log.warning("worker_died", pid=process.pid, exitcode=process.exitcode, quick=quick)
            _forget_metrics_of(process)
            if self._quick_deaths >= _MAX_QUICK_DEATHS:
                return False
            self._respawn_at = now + min(_MAX_BACKOFF_S, 2.0 ** (self._quick_deaths - 1)) if quick else now
            self._workers[index] = self._spawn(sock)
        return True

    def _pass_on(self, sig: int) -> None:
        for worker in self._workers:
            pid = worker.process.pid
            if worker.process.is_alive() and pid is not None:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:  # ended meanwhile
                    pass

    def _stop(self, sock: socket.socket) -> int:
        first = self._stop_signals[0]
        log.info("workers_stopping", signal=signal.Signals(first).name, wait_s=self.stop_wait_s)
        sock.close()  # the workers' own listeners close after the grace: then connections are refused
        self._pass_on(DRAIN_SIGNAL if first == signal.SIGTERM else signal.SIGINT)
        deadline = time.monotonic() + self.stop_wait_s
        for worker in self._workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
        left = [w.process for w in self._workers if w.process.is_alive()]
        for process in left:
            log.error("worker_killed", pid=process.pid)
            process.kill()
            process.join()
        for worker in self._workers:
            _forget_metrics_of(worker.process)
        codes = [w.process.exitcode for w in self._workers]
        log.info("workers_stopped", exitcodes=codes, killed=len(left))
        # killed by a signal the parent passed on (or a direct one) before its server took the
        # signals over: a worker still booting, which had served nothing
        clean = (0, -signal.SIGTERM, -signal.SIGINT, -DRAIN_SIGNAL)
        return 0 if not left and all(code in clean for code in codes) else 1


def _forget_metrics_of(process: SpawnProcess) -> None:
    """Drop a dead worker's live gauges from the shared metrics (its counters stay in the sums)."""
    if process.pid is not None and os.environ.get(METRICS_DIR_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(process.pid)
