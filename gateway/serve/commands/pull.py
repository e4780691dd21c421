"""`fleetgate pull --config FILE`: fetch every model address of a config into its cache ahead of
serving (the Kubernetes init container runs it), so the gateway starts from the cache."""

from __future__ import annotations

import argparse
import sys

from gateway.config import ConfigError, load_config
from gateway.serve.commands.base import AddParser


def register(add_parser: AddParser) -> None:
    p = add_parser("pull", help="fetch the models a config names (hf://, s3://, https://) into its cache")
    p.add_argument("--config", required=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from backends.sources import ModelSources, SourceError
    from backends.sources.progress import progress_for
    from gateway.config.sources import config_addresses

    config = load_config(args.config)
    sources = ModelSources(config.storage)
    progress = progress_for(sys.stderr)
    addresses = config_addresses(config)
    for where, text in addresses:
        try:
            path = sources.fetch(text, progress)
        except SourceError as exc:
            raise ConfigError(f"{exc} - at `{where}`") from None
        manifest = sources.cache.lookup(text)  # the exact version served: a commit, a listing digest
        revision = f" ({manifest.revision})" if manifest is not None else ""
        sys.stdout.write(f"{text} -> {path}{revision}\n")
    sys.stdout.write(f"{len(addresses)} model addresses in {sources.cache.root}\n")
    return 0
