"""`fleetgate serve --config FILE`: run the gateway under uvicorn, one process or supervised workers."""

from __future__ import annotations

import argparse
from typing import Any

from gateway.config import load_config, with_listen_overrides
from gateway.serve.commands.base import AddParser


def register(add_parser: AddParser) -> None:
    p = add_parser("serve", help="serve the gateway")
    p.add_argument("--config", required=True)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--http", choices=("auto", "httptools", "h11"), default="auto", help="HTTP/1.1 parser")
    p.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto", help="event loop")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from backends.cores import WORKERS_ENV
    from gateway.http.app import create_app, create_served_app
    from gateway.observe.logs import configure_logging
    from gateway.serve.drain import DrainingServer

    listen = {k: v for k, v in (("host", args.host or None), ("port", args.port)) if v is not None}
    config = with_listen_overrides(load_config(args.config), listen)
    from gateway.serve.openmp import reexec_with_intel_openmp

    reexec_with_intel_openmp(config, args.argv)  # returns unless it re-executes (see the module)
    configure_logging(config.server.log_level)
    options: dict[str, Any] = dict(
        host=config.server.host,
        port=config.server.port,
        log_level="warning",
        access_log=False,  # fleetgate writes its own access line, with tenant and deployment
        timeout_keep_alive=30,
        # a client that never finishes its request cannot keep the process alive after SIGTERM
        timeout_graceful_shutdown=config.server.shutdown_timeout_s,
        limit_concurrency=config.server.max_connections,
        # X-Forwarded-* only from the configured proxies (uvicorn believes 127.0.0.1 by default, so
        # a local client could pick its own address and escape the admin lockout)
        proxy_headers=bool(config.server.trusted_proxies),
        forwarded_allow_ips=list(config.server.trusted_proxies) or None,
        # "auto" = httptools and uvloop (installed with fleetgate): bench/bench_http_stack.py measured
        # ~20 % less server CPU per request than h11 + asyncio, which stay selectable.
        http=args.http,
        loop=args.loop,
    )
    if args.http in ("auto", "httptools") and _has_httptools():
        from gateway.serve.http_protocol import HeaderDeadlineProtocol, limits_of

        # connection limits (gateway/serve/http_protocol.py); each worker sets its own from the config
        options["http"] = HeaderDeadlineProtocol.configure(limits_of(config.server))
    if config.server.workers > 1:
        # each worker drains on SIGTERM like a lone gateway (gateway/serve/supervisor.py)
        from gateway.serve.supervisor import DrainingSupervisor
        from gateway.serve.workers import prepare_environment

        create_app(config)  # every deployment's options and files are checked before forking
        prepare_environment(args.config, listen, config.server.workers)
        worker_config = uvicorn.Config("gateway.serve.workers:create_worker_app", factory=True, **options)
        return DrainingSupervisor(
            worker_config, config.server.workers, config.server.drain_grace_s, config.server.shutdown_timeout_s
        ).run()
    # one process: its runtimes keep their own thread defaults, whatever the environment says
    os.environ.pop(WORKERS_ENV, None)
    app = create_served_app(config, args.config, listen)
    server = DrainingServer(uvicorn.Config(app, **options), app.state.drain, config.server.drain_grace_s)
    server.run()
    return 0


def _has_httptools() -> bool:
    import importlib.util

    return importlib.util.find_spec("httptools") is not None
