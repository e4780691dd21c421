"""Run ASGI apps on a free loopback port inside the test process (real HTTP, real sockets)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port() -> int:
    """A loopback port nobody listens on, never one this process was handed before.

    The kernel may offer the same free port to two calls in a row while neither is bound yet
    (a fixture that picks a gRPC port and then an HTTP port did: both got one port, and the second
    server failed to bind), so ports already handed out are skipped.
    """
    with _HANDED_OUT_LOCK:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


@contextmanager
def serve_app(app: Any, *, timeout_s: float = 60.0, port: int | None = None) -> Iterator[str]:
    """Serve `app` with uvicorn in a thread; yields its base URL; stops it (lifespan shutdown) after."""
    port = port or free_port()
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the test server failed to start")
        if time.monotonic() > deadline:
            raise TimeoutError("the test server did not start in time")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
