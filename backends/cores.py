"""The CPU cores this process's runtimes may use by default.

A process runs on the CPUs of its affinity (a container's cpuset, `taskset`). With `server.workers:
N`, N gateway processes share them: the supervisor tells its workers how many they are
(`FLEETGATE_WORKERS`, `gateway/serve/workers.py`), and a runtime left at its default thread count takes
one worker's share of the CPUs instead of its own default (ONNX Runtime and torch: a thread per
physical core; OpenVINO: every core). Otherwise each of N workers would start that many threads, N
times what the cores hold, and each run would wait on threads the others hold. The share counts
logical CPUs (what the affinity lists), so on a host with two hardware threads a core and two
workers it equals those runtimes' own default. A thread count set in a deployment's options always
wins. A gateway that is not a worker clears the variable (`gateway/serve/commands/serve.py`), so a stray one cannot
cap its runtimes.
"""

from __future__ import annotations

import os

#: set by the supervisor for its workers: how many gateway processes share this machine's cores
WORKERS_ENV = "FLEETGATE_WORKERS"


def available_cores() -> int:
    """CPUs this process may run on (its affinity: a container's cpuset, `taskset`)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def sharing_workers() -> int:
    """Gateway processes sharing the cores: `FLEETGATE_WORKERS`, else 1 (a value that is not a
    positive integer counts as 1: the runtimes' own defaults then apply, as without workers)."""
    try:
        workers = int(os.environ.get(WORKERS_ENV, ""))
    except ValueError:
        return 1
    return max(1, workers)


def cores_per_worker() -> int:
    """This process's share of the cores (at least 1)."""
    return max(1, available_cores() // sharing_workers())


def default_threads() -> int | None:
    """Threads a CPU runtime left at its default should use: one worker's share of the cores when
    several workers share them, else None (the runtime's own default, every core)."""
    return cores_per_worker() if sharing_workers() > 1 else None
