"""A busy gRPC port ends `fleetgate serve` at once with one line naming the port, what holds it and
the setting to change (it used to end the start with a 58-line exception-group traceback)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.grpc.ports import GrpcPortBusy, check_port_free
from tests.servers import free_port


@pytest.fixture
def held_port() -> Iterator[int]:
    """A port another program listens on (this test process, as a plain listener)."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port()))
        holder.listen()
        yield holder.getsockname()[1]


def _serve(config: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {k: v for k, v in os.environ.items() if k != "FLEETGATE_GRPC_PORT"}  # the config decides
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "gateway.serve.cli", "serve", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    return out, time.monotonic() - started


def _one_line(out: subprocess.CompletedProcess[str]) -> str:
    text = out.stdout + out.stderr
    assert "Traceback" not in text, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize("form", ["explicit", "auto"])
def test_a_busy_grpc_port_is_one_line_and_a_quick_failed_exit(tmp_path: Path, held_port: int, form: str) -> None:
    config = tmp_path / "gw.yaml"
    if form == "explicit":
        config.write_text(f'server: {{port: {free_port()}, grpc_port: {held_port}}}\nstate: {{url: "memory://"}}\n')
        out, took = _serve(config)
    else:  # the default: the HTTP port + 1, here moved by --port
        config.write_text('state: {url: "memory://"}\n')
        out, took = _serve(config, "--port", str(held_port - 1))
    line = _one_line(out)
    assert out.returncode != 0
    assert f"127.0.0.1:{held_port}" in line and "already in use" in line
    assert f"pid {os.getpid()}" in line  # what holds it
    assert "server.grpc_port" in line  # the setting to change
    assert took < 60, took


def test_a_port_shared_by_a_sibling_worker_is_not_busy() -> None:
    """Gateway workers each bind the gRPC port with SO_REUSEPORT: a sibling's listener is not a conflict."""
    with socket.socket() as sibling:
        sibling.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sibling.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sibling.bind(("127.0.0.1", 0))
        sibling.listen()
        port = sibling.getsockname()[1]
        check_port_free("127.0.0.1", port)
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen()
        with pytest.raises(GrpcPortBusy, match="server.grpc_port"):
            check_port_free("127.0.0.1", plain.getsockname()[1])
