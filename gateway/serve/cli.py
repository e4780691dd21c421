"""The `fleetgate` command: its parser, and `main`, which runs one subcommand.

The subcommands live in `gateway/serve/commands/`, one module each; `COMMANDS` below registers
them in the order `fleetgate --help` lists them. A new command is one new module there plus one
line here.
"""

from __future__ import annotations

import argparse
import sys

from gateway.config import ConfigError
from gateway.serve.commands import (
    audit,
    build_kernels,
    cache,
    check_config,
    demo_models,
    export_llm,
    keys,
    pull,
    quantize,
    serve,
    usage,
)
from gateway.serve.commands.base import EXIT_UNAVAILABLE, fail
from policies.errors import StoreUnavailable

#: every subcommand's module (each has `register(add_parser)`), in --help order
COMMANDS = (serve, check_config, pull, cache, demo_models, build_kernels, quantize, export_llm, keys, usage, audit)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fleetgate")
    except PackageNotFoundError:  # run from a checkout that was never installed
        from fleetgate import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetgate", description="One API endpoint for an inference fleet.")
    parser.add_argument("--version", action="version", version=f"fleetgate {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub.add_parser)
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
        return fail(str(exc))
    except StoreUnavailable as exc:
        # Not the user's input: the state store is down or the URL points nowhere. One line, no traceback.
        print(f"fleetgate: state store unavailable ({exc.detail})", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
