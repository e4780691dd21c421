"""A SIGTERM can land while the gateway writes a log line (gateway/serve/drain.py).

Python runs a signal handler between two bytecodes of whatever the main thread was doing. Under load
that is often the write of a request's access line, inside structlog's stream lock, which is not
reentrant: a handler that logs there waits on a lock its own thread holds, forever, and the drain
never starts. The handler must only set flags and leave the logging to the loop.

Each scenario runs in a fresh interpreter (its own logging set-up, a real signal), so that a
deadlock fails the test by its timeout instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[2]


class _SignalledStream:
    """A stdout (bytes under `.buffer`) that sends this process SIGTERM from inside its first write:
    the handler then runs with the log stream's lock held, as under load."""

    def __init__(self) -> None:
        self.buffer = self
        self.lines: list[bytes] = []
        self._signal_once = True

    def write(self, data: bytes) -> int:
        self.lines.append(bytes(data))
        if self._signal_once:
            self._signal_once = False
            os.kill(os.getpid(), signal.SIGTERM)
            sum(range(100))  # a few bytecodes, still inside the write: the handler runs here
        return len(data)

    def flush(self) -> None:
        pass


def _sigterm_inside_a_log_write() -> None:
    """The scenario, run in its own interpreter: prints the events logged, one JSON line."""
    import structlog
    import uvicorn

    from gateway.core.drain_state import DrainState
    from gateway.observe.logs import configure_logging
    from gateway.serve.drain import DrainingServer

    async def main() -> None:
        state = DrainState()
        server = DrainingServer(uvicorn.Config(app=lambda scope, receive, send: None), state, grace_s=0.05)
        server._loop = asyncio.get_running_loop()  # as serve() sets it
        signal.signal(signal.SIGTERM, server.handle_exit)
        stream = _SignalledStream()
        configure_logging("info", stream=stream)  # type: ignore[arg-type]
        structlog.get_logger("test").info("request", status=200)  # the signal lands in this write
        assert state.draining and not state.refusing
        await asyncio.sleep(0.3)  # the grace passes
        assert state.refusing and server.should_exit
        events = [msgspec.json.decode(line)["event"] for line in stream.lines]
        sys.__stdout__.write(msgspec.json.encode(events).decode() + "\n")

    asyncio.run(main())


def test_a_sigterm_during_a_log_write_starts_the_drain_without_deadlock() -> None:
    code = f"from {__name__} import _sigterm_inside_a_log_write as s; s()"
    try:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError("the SIGTERM handler blocked on the log stream's lock: the drain never started") from None
    assert done.returncode == 0, done.stderr[-3000:]
    events = msgspec.json.decode(done.stdout.strip().splitlines()[-1])
    assert events == ["request", "drain_started", "drain_refusing_new_requests"]
