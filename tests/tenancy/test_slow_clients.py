"""Slow clients are dropped: a header block trickled in is cut at `server.header_timeout_s`."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import httpx

from tests.tenancy.conftest import gateway_processes, write_config


def test_a_header_block_never_finished_is_closed_and_does_not_hold_shutdown(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "gw.yaml", 'server: {header_timeout_s: 1, graceful_shutdown_s: 2}\nstate: {url: "memory://"}\n'
    )
    with gateway_processes([config], tmp_path) as (gw,):
        host, port = gw.url.removeprefix("http://").split(":")
        slow = socket.create_connection((host, int(port)), timeout=10)
        slow.sendall(b"GET /health/live HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        started = time.monotonic()
        assert slow.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < 8  # at the 1 s header deadline, far below the 10 s socket timeout
        # a normal client is served all the while
        assert httpx.get(f"{gw.url}/health/live").status_code == 200
        lingering = socket.create_connection((host, int(port)), timeout=10)
        lingering.sendall(b"GET /health/live HTTP/1.1\r\n")
        stopping = time.monotonic()
        gw.kill(signal.SIGTERM)  # (SIGKILL after 10 s if it were still up)
        # it stopped by itself (uvicorn re-raises the SIGTERM it handled: -15), not killed at 10 s
        assert gw.proc.returncode in (0, -signal.SIGTERM) and time.monotonic() - stopping < 8
        slow.close()
        lingering.close()
