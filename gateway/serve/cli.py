"""The `fleetgate` command: serve, check-config, demo-models, build-kernels, quantize, keys, usage.

Errors a user can fix (a bad config, an unknown tenant) print one line on stderr and exit 2; an
unreachable state store prints one line and exits 1. None of them prints a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.config import Config, ConfigError, load_config, with_listen_overrides
from policies.errors import StoreUnavailable

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 1


def _fail(message: str) -> int:
    print(f"fleetgate: {message}", file=sys.stderr)
    return EXIT_USAGE


def _load(path: str) -> Config:
    return load_config(path)


def cmd_check_config(args: argparse.Namespace) -> int:
    from gateway.http.app import create_app

    config = _load(args.config)
    create_app(config)  # builds every deployment's backend: options and files are checked too
    print(
        f"{args.config}: ok ({len(config.deployments)} deployments, {len(config.models)} models, "
        f"{len(config.graphs)} graphs, {len(config.tenants)} tenants)"
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from backends.cores import WORKERS_ENV
    from gateway.http.app import create_app, create_served_app
    from gateway.observe.logs import configure_logging
    from gateway.serve.drain import DrainingServer

    listen = {k: v for k, v in (("host", args.host or None), ("port", args.port)) if v is not None}
    config = with_listen_overrides(_load(args.config), listen)
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


def cmd_demo_models(args: argparse.Namespace) -> int:
    import os

    # TensorFlow (for the SavedModel) is chatty on stderr at import; keep the command's output readable.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    from backends.demo_models.digits import write_all

    written = write_all(Path(args.out), savedmodel=not args.no_savedmodel, llama=not args.no_llama)
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


def cmd_build_kernels(args: argparse.Namespace) -> int:
    """Build the native code of this install (the LLM engine's CPU kernels) so that no serving
    process compiles anything; one line per library, exit 1 when one failed."""
    try:
        import torch  # noqa: F401 - only to know whether the engine is installed
    except ImportError:
        print("torch is not installed (the `torch` extra): no engine kernels to build", file=sys.stderr)
        torch_results: list[Any] = []
    else:
        from backends.torch_llm.build_kernels import build_all

        torch_results = build_all()
    failed = 0
    for result in torch_results:
        took = f" in {result.seconds:.1f} s" if result.outcome == "built" else ""
        print(f"{result.outcome} {result.prefix}{took}: {result.library}")
        if result.outcome == "failed":
            failed += 1
            print(
                f"fleetgate: {result.prefix} did not build ({result.error}); engines serve without it",
                file=sys.stderr,
            )
    return 1 if failed else 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetgate")
    except PackageNotFoundError:  # run from a checkout that was never installed
        from fleetgate import __version__

        return __version__


def cmd_quantize(args: argparse.Namespace) -> int:
    import contextlib

    from backends.lazy import MissingRuntime
    from backends.openvino.quantize import quantize_to_int8, quantized_op_counts

    try:
        # NNCF draws progress bars on stdout; stdout carries only the answer line
        with contextlib.redirect_stdout(sys.stderr):
            out = quantize_to_int8(
                args.model,
                args.calibration,
                args.out,
                input_name=args.input,
                subset_size=args.subset_size,
                preset=args.preset,
            )
    except (ValueError, MissingRuntime) as exc:
        return _fail(str(exc))
    counts = quantized_op_counts(out)
    if counts["fake_quantize"] == 0:
        print(f"fleetgate: NNCF found nothing to quantize in {args.model}", file=sys.stderr)
    print(
        f"{out}: {counts['fake_quantize']} FakeQuantize, {counts['quantized_ops']} quantized ops, "
        f"{counts['int8_weights']} int8 weight tensors"
    )
    return 0


async def _with_store(config: Config, work: Callable[[Any, Any], Awaitable[int]]) -> int:
    from policies.admission import Admission
    from policies.keys import KeyService
    from policies.stores import open_store

    if config.state.url.startswith("memory://"):
        raise ConfigError(
            "the state is memory:// (it lives inside the server process), so nothing written here "
            "would reach a server: create keys through the running server's admin API "
            "(POST /admin/keys with the admin key), or use `state: {url: sqlite:///...}`"
        )
    store = await open_store(config.state.url)
    try:
        keys = KeyService(store, time.time, tenants=list(config.tenants))
        admission = Admission(store, config.tenants, time.time)
        return await work(keys, admission)
    finally:
        await store.close()


def _parse_expiry(value: str | None) -> datetime | None:
    if value is None:
        return None
    if value[-1:] in ("d", "h") and value[:-1].isdigit():
        seconds = int(value[:-1]) * (86400 if value.endswith("d") else 3600)
        try:
            return datetime.fromtimestamp(time.time() + seconds, tz=UTC)
        except (ValueError, OverflowError, OSError):
            raise ConfigError(f"--expires {value!r}: too far in the future") from None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(
            f"--expires {value!r}: use an ISO time (2027-01-31T00:00:00Z) or a duration like 30d"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _check_tenant(config: Config, tenant: str | None) -> None:
    """A `--tenant` filter naming no configured tenant is a typo, not an empty answer."""
    if tenant is not None and tenant not in config.tenants:
        configured = ", ".join(sorted(config.tenants)) or "none"
        raise ConfigError(f"unknown tenant {tenant!r} (configured: {configured})")


async def _valid_kept_secret(keys: Any, path: Path, tenant: str) -> str | None:
    """The secret kept in `path` when it is still an active key of `tenant` in this store, else
    None (no file, revoked, expired, another tenant's, or the store was reset)."""
    from policies.errors import Unauthenticated

    try:
        secret = path.read_text().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"--secret-file {path}: {exc.strerror}") from None
    try:
        principal = await keys.authenticate(secret)
        await keys.uses_written()  # its last-use write, before the store closes under it
    except Unauthenticated:
        print(f"the key kept in {path} is no longer valid: creating another", file=sys.stderr)
        return None
    if principal.tenant != tenant:
        print(f"the key kept in {path} belongs to another tenant: creating another", file=sys.stderr)
        return None
    print(f"reusing key {principal.key_id} of tenant {tenant} kept in {path}", file=sys.stderr)
    return secret


def _keep_secret(path: Path, secret: str) -> None:
    """Write `secret` to `path`, readable by its owner only, replacing it whole (never half-written)."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.unlink(missing_ok=True)  # a left-over one would keep its mode: created afresh, 0600
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secret + "\n")
    os.replace(partial, path)


def cmd_keys(args: argparse.Namespace) -> int:
    config = _load(args.config)
    if args.action == "list":
        _check_tenant(config, args.tenant)

    async def create(keys: Any, _: Any) -> int:
        kept = Path(args.secret_file) if args.secret_file else None
        if kept is not None:
            reused = await _valid_kept_secret(keys, kept, args.tenant)
            if reused is not None:
                print(reused)
                return 0
        try:
            record, secret = await keys.create(
                args.tenant, args.models or None, _parse_expiry(args.expires), args.name
            )
        except ValueError as exc:
            return _fail(str(exc))
        if kept is not None:
            _keep_secret(kept, secret)
        where = f"kept in {kept} (mode 0600)" if kept else "the secret is shown once"
        print(f"created key {record.key_id} for tenant {record.tenant}; {where}:", file=sys.stderr)
        print(secret)
        return 0

    async def list_(keys: Any, _: Any) -> int:
        for r in await keys.list(args.tenant):
            state = "revoked" if r.revoked_at else ("expired" if not r.active(time.time()) else "active")
            expires = r.expires_at.isoformat() if r.expires_at else "never"
            print(
                f"{r.key_id}\t{r.tenant}\t{state}\tmodels={','.join(r.models)}\texpires={expires}\t{r.name or ''}"
            )
        return 0

    async def revoke(keys: Any, _: Any) -> int:
        if not await keys.revoke(args.key_id):
            return _fail(f"no key {args.key_id!r}")
        print(f"revoked {args.key_id}")
        return 0

    action = {"create": create, "list": list_, "revoke": revoke}[args.action]
    return asyncio.run(_with_store(config, action))


def cmd_usage(args: argparse.Namespace) -> int:
    config = _load(args.config)
    _check_tenant(config, args.tenant)

    async def report(_: Any, admission: Any) -> int:
        rows = await admission.usage(args.tenant)
        print("tenant\tmodel\tperiod\trequests\ttokens")
        for row in rows:
            print(f"{row.tenant}\t{row.model}\t{row.period}\t{row.requests}\t{row.tokens}")
        return 0

    return asyncio.run(_with_store(config, report))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetgate", description="One API endpoint for an inference fleet.")
    parser.add_argument("--version", action="version", version=f"fleetgate {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve the gateway")
    p.add_argument("--config", required=True)
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--http", choices=("auto", "httptools", "h11"), default="auto", help="HTTP/1.1 parser")
    p.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto", help="event loop")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("check-config", help="check a config file and exit")
    p.add_argument("config")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("demo-models", help="build the demo models locally")
    p.add_argument("--out", default="models")
    p.add_argument(
        "--no-savedmodel", action="store_true", help="skip the TF SavedModel (no TensorFlow needed)"
    )
    p.add_argument("--no-llama", action="store_true", help="skip the tiny Llama (no torch needed)")
    p.set_defaults(func=cmd_demo_models)

    p = sub.add_parser(
        "build-kernels", help="build the native code of this install once (the engine's CPU kernels)"
    )
    p.set_defaults(func=cmd_build_kernels)

    p = sub.add_parser("quantize", help="post-training INT8 quantization of a model for OpenVINO on CPU")
    p.add_argument("--model", required=True, help="the f32 model: .onnx or OpenVINO IR .xml")
    p.add_argument(
        "--calibration", required=True, help="representative input rows: .npy, or .npz keyed by input name"
    )
    p.add_argument("--out", required=True, help="the INT8 IR to write (.xml; its .bin goes beside it)")
    p.add_argument("--input", help="the input the rows feed (required when the model has several)")
    p.add_argument("--subset-size", type=int, default=300, help="calibration rows used at most")
    p.add_argument("--preset", choices=("performance", "mixed"), default="performance")
    p.set_defaults(func=cmd_quantize)

    p = sub.add_parser("keys", help="create, list or revoke tenant API keys")
    keys = p.add_subparsers(dest="action", required=True)
    k = keys.add_parser("create", help="create a key; prints the secret alone on stdout, once")
    k.add_argument("--config", required=True)
    k.add_argument("--tenant", required=True)
    k.add_argument("--models", nargs="*", help="model globs the key is restricted to")
    k.add_argument("--expires", help="ISO time or a duration like 30d / 12h")
    k.add_argument("--name")
    k.add_argument(
        "--secret-file",
        help="keep the secret in this file (mode 0600) and print it again, without creating a key, "
        "while it is an active key of the tenant (what `make run` does with var/demo-key)",
    )
    k.set_defaults(func=cmd_keys)
    k = keys.add_parser("list", help="list keys (never their secrets)")
    k.add_argument("--config", required=True)
    k.add_argument("--tenant")
    k.set_defaults(func=cmd_keys)
    k = keys.add_parser("revoke", help="revoke a key on every replica")
    k.add_argument("--config", required=True)
    k.add_argument("key_id")
    k.set_defaults(func=cmd_keys)

    p = sub.add_parser("usage", help="usage per tenant, model and period")
    p.add_argument("--config", required=True)
    p.add_argument("--tenant")
    p.set_defaults(func=cmd_usage)
    return parser


def main(argv: list[str] | None = None) -> int:
    from gateway.observe.logs import configure_logging

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what `serve` re-executes with
    if args.command != "serve":
        configure_logging("warning", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        return _fail(str(exc))
    except StoreUnavailable as exc:
        # Not the user's input: the state store is down or the URL points nowhere. One line, no traceback.
        print(f"fleetgate: state store unavailable ({exc.detail})", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
