"""`fleetgate check-config FILE`: decode and check a config, build every backend, and exit."""

from __future__ import annotations

import argparse

from gateway.config import load_config
from gateway.serve.commands.base import AddParser


def register(add_parser: AddParser) -> None:
    p = add_parser("check-config", help="check a config file and exit")
    p.add_argument("config")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gateway.config.sources import resolve_all
    from gateway.http.app import create_app

    config = load_config(args.config)
    # model addresses resolved at their stores (nothing downloaded): not found, forbidden, no room
    for line in resolve_all(config):
        print(f"{args.config}: {line}")
    create_app(config)  # builds every deployment's backend: options and files are checked too
    print(
        f"{args.config}: ok ({len(config.deployments)} deployments, {len(config.models)} models, "
        f"{len(config.graphs)} graphs, {len(config.tenants)} tenants)"
    )
    return 0
