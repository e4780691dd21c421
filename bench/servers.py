"""Start-up helpers the benches share for the servers they launch as subprocesses.

A free loopback port, waiting until a server answers its readiness URL, and stopping it (its
process group too). Kept apart from the benches so that bench_tensor_peers and floor_servers, which
both start servers, need not import each other.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

#: the repository root: the working directory for `python -m bench.<name>` subprocesses
ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 120) -> None:
    """Poll `url` until it answers 200; RuntimeError with the tail of `log` if `proc` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"not ready at {url} (exit code {proc.poll()}); log tail: {log.read_text()[-1500:]}")


def stop(proc: subprocess.Popen[bytes], group: bool = True) -> None:
    """SIGTERM to `proc` (to its process group if `group`: BentoML forks workers), SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    kill = (lambda sig: os.killpg(proc.pid, sig)) if group else proc.send_signal
    kill(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        kill(signal.SIGKILL)
        proc.wait()
