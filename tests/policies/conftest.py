"""Fixtures of the policy tests: a real redis-server, a movable clock, every store kind.

The redis-server runs once per session on a free loopback port, with persistence off, and is stopped
by its pid. Where `redis-server` is missing it is installed with apt when running as root; otherwise
the redis-backed tests skip with the reason.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from policies.stores import StateStore, open_store
from tests.servers import free_port


class FakeClock:
    """Epoch seconds that only move when a test says so."""

    def __init__(self, start: datetime = datetime(2026, 11, 21, 10, 0, 0, tzinfo=UTC)) -> None:
        self.now = start.timestamp()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def _redis_binary() -> str | None:
    found = shutil.which("redis-server")
    if found or os.geteuid() != 0:
        return found
    subprocess.run(
        ["apt-get", "install", "-y", "redis-server"], check=False, capture_output=True, timeout=300
    )
    return shutil.which("redis-server")


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real redis-server started for this session (skips when none can be had)."""
    binary = _redis_binary()
    if binary is None:
        pytest.skip(
            "redis-server is not installed and cannot be (not root): `apt-get install -y redis-server`"
        )
    work = tmp_path_factory.mktemp("redis")
    pidfile = work / "redis.pid"
    port = free_port()
    subprocess.run(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--daemonize", "yes", "--pidfile", str(pidfile), "--dir", str(work),
         "--logfile", str(work / "redis.log")],
        check=True,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"redis-server did not answer on port {port}: {(work / 'redis.log').read_text()}"
            )
        time.sleep(0.05)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        pid = int(pidfile.read_text().strip()) if pidfile.exists() else None
        if pid:
            os.kill(pid, 15)


Opener = Callable[[], Awaitable[StateStore]]


@pytest.fixture(params=["memory", "sqlite", "redis"])
async def replicas(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Opener]:
    """Opens store instances that share state, as two gateway replicas would (memory: one instance)."""
    kind = request.param
    opened: list[StateStore] = []
    if kind == "memory":
        shared = await open_store("memory://")
        opened.append(shared)

        async def opener() -> StateStore:
            return shared
    else:
        if kind == "sqlite":
            url = f"sqlite:///{tmp_path / 'state.db'}"
        else:
            # A fresh key prefix per test: tests never see each other's state, no FLUSHDB needed.
            url = f"{request.getfixturevalue('redis_url')}?prefix=t{uuid.uuid4().hex[:12]}:"

        async def opener() -> StateStore:
            store = await open_store(url)
            opened.append(store)
            return store

    yield opener
    for store in opened:
        await store.close()


@pytest.fixture
async def store(replicas: Opener) -> StateStore:
    """One store of each kind."""
    return await replicas()
