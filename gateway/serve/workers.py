"""`server.workers: N`: N gateway processes on one port, sharing keys, limits and quotas.

uvicorn's supervisor binds the port once and starts N worker processes that accept on it. Each
worker is a whole gateway: it loads its own copy of every model (memory and runtime threads times
N), runs its own fair queues and circuit breakers, and reaches the shared state store, so keys,
limits, quotas and usage are exact across workers exactly as across replicas (a `memory://` state
is refused: it would be one private state per worker). `/metrics` sums the workers' counters and
histograms through Prometheus' multiprocess mode (gauges carry a `pid` label).

Sizing: on CPU, N x (the runtimes' threads per worker) should not exceed the cores. A runtime left
at its default thread count (ONNX Runtime's `intra_op_threads`, OpenVINO's `num_threads` on the CPU,
the LLM engine's `num_threads`) takes one worker's share of the cores (`backends/cores.py`); one set
explicitly is taken as given. On one GPU, keep one worker: each would load the model again into GPU
memory.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from litestar import Litestar

from gateway.observe.multiprocess import METRICS_DIR_ENV

#: read by each worker process: the config file and the command line's host/port
CONFIG_ENV = "FLEETGATE_WORKER_CONFIG"
LISTEN_ENV = "FLEETGATE_WORKER_LISTEN"


def prepare_environment(config_path: str, listen: dict[str, object], workers: int) -> None:
    """In the supervisor, before workers start: where they find the config, how many share the
    cores (runtimes left at their default threads take one worker's share), and where metrics go."""
    import json

    from backends.cores import WORKERS_ENV

    os.environ[CONFIG_ENV] = str(Path(config_path).resolve())
    os.environ[WORKERS_ENV] = str(workers)
    os.environ[LISTEN_ENV] = json.dumps(listen)
    if not os.environ.get(METRICS_DIR_ENV):
        os.environ[METRICS_DIR_ENV] = tempfile.mkdtemp(prefix="fleetgate-metrics-")


def create_worker_app() -> Litestar:
    """The app factory each worker process calls (uvicorn `factory=True`)."""
    import importlib.util
    import json

    from gateway.config import load_config, with_listen_overrides
    from gateway.http.app import create_served_app
    from gateway.observe.logs import configure_logging

    path = os.environ[CONFIG_ENV]
    listen = json.loads(os.environ.get(LISTEN_ENV, "{}"))
    config = with_listen_overrides(load_config(path), listen)
    configure_logging(config.server.log_level)
    if importlib.util.find_spec("httptools") is not None:  # the httptools server runs (gateway/serve/commands/serve.py)
        from gateway.serve.http_protocol import HeaderDeadlineProtocol, limits_of

        # this process's connection limits (the protocol class came from the parent by reference)
        HeaderDeadlineProtocol.configure(limits_of(config.server))
    return create_served_app(config, path, listen)
