"""Clients that ignore readiness and keep sending through a SIGTERM drain (gateway/serve/drain.py,
gateway/serve/http_protocol.py): every request sent on a connection the gateway accepted is answered
(a 503 with `Connection: close` once it refuses new work); only connections made after its listener
closed are refused. Before, a few requests got a connection reset: a connection still in the
kernel's accept queue when the listener closed, or an idle kept-alive one closed under a request.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.tenancy.conftest import gateway_processes, write_config

CLIENTS = 8
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\ncontent-type: application/json\r\n"
    b'content-length: 2\r\n\r\n{}'
)


@dataclass
class Tally:
    answered: dict[int, int] = field(default_factory=dict)
    refused_connects: int = 0
    #: connections that failed otherwise than refused (none expected)
    connect_errors: list[str] = field(default_factory=list)
    #: requests sent and never answered: (what happened, seconds after the signal)
    lost: list[tuple[str, float]] = field(default_factory=list)


def _read_response(sock: socket.socket, pending: bytearray) -> tuple[int, bool]:
    """(status, the server closes the connection) of the next response on `sock`."""
    while b"\r\n\r\n" not in pending:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError("closed before a response")
        pending += chunk
    head, _, rest = bytes(pending).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError("closed inside a response")
        rest += chunk
    pending[:] = rest[length:]
    return int(lines[0].split()[1]), headers.get("connection", "").lower() == "close"


def _client(address: tuple[str, int], keep_alive: bool, stop: threading.Event, tally: Tally, lock: threading.Lock,
            signalled: list[float]) -> None:  # fmt: skip
    """Send requests back to back until the gateway refuses a connection (or `stop`): on one
    kept-alive connection as long as the server keeps it, or on a new connection each time."""
    sock: socket.socket | None = None
    pending = bytearray()
    used = 0
    while not stop.is_set():
        if sock is None:
            try:
                sock = socket.create_connection(address, timeout=10)
            except (ConnectionRefusedError, ConnectionResetError):  # reset in the handshake: refused too
                with lock:
                    tally.refused_connects += 1
                return  # the listener is closed: this is the one allowed outcome
            except OSError as exc:
                with lock:
                    tally.connect_errors.append(repr(exc))
                return
            pending.clear()
            used = 0
        try:
            sock.sendall(REQUEST)
            status, closing = _read_response(sock, pending)
        except (OSError, EOFError) as exc:  # reset, broken pipe, or closed without an answer
            with lock:
                tally.lost.append(
                    (f"{type(exc).__name__} keep_alive={keep_alive} after={used}", time.monotonic() - (signalled or [0.0])[0])
                )
            sock.close()
            sock = None
            continue
        used += 1
        with lock:
            tally.answered[status] = tally.answered.get(status, 0) + 1
        if closing or not keep_alive:
            sock.close()
            sock = None
    if sock is not None:
        sock.close()


def test_clients_that_keep_sending_through_a_drain_are_answered_or_refused_never_reset(tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "gw.yaml",
        "server: {grpc_port: null, drain_grace_s: 0.5, drain_timeout_s: 5}\n"
        'state: {url: "memory://"}\ntenants: {acme: {}}\n',
    )
    with gateway_processes([config], tmp_path) as (gw,):
        host, port = gw.url.removeprefix("http://").split(":")
        tally, lock, stop, signalled = Tally(), threading.Lock(), threading.Event(), []
        threads = [
            threading.Thread(
                target=_client, args=((host, int(port)), i % 2 == 0, stop, tally, lock, signalled), daemon=True
            )
            for i in range(CLIENTS)
        ]
        for t in threads:
            t.start()
        time.sleep(1.0)  # every client is sending
        signalled.append(time.monotonic())
        gw.proc.send_signal(signal.SIGTERM)
        try:
            gw.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            events = [line for line in gw.log.read_text().splitlines() if '"event":"request"' not in line]
            raise AssertionError(f"no exit 30 s after SIGTERM: {events[-30:]}") from None
        stop.set()
        for t in threads:
            t.join(15)
    assert gw.proc.returncode == 0, gw.log.read_text()[-3000:]
    events = [line for line in gw.log.read_text().splitlines() if '"event":"request"' not in line]
    assert tally.lost == [], (tally.lost, tally.answered, events[-12:])
    assert tally.answered.get(401, 0) > 0  # served before the refusal (no key)...
    assert tally.answered.get(503, 0) > 0  # ...then refused with an answer
    assert set(tally.answered) <= {401, 503}, tally.answered
    assert tally.connect_errors == []
    assert tally.refused_connects == CLIENTS  # every client ended at the closed listener
