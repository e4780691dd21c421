"""`fleetgate cache ls|rm`: what the model cache holds, and removing entries (blobs that another
entry still uses are kept)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from gateway.config import ConfigError, load_config
from gateway.serve.commands.base import AddParser


def register(add_parser: AddParser) -> None:
    p = add_parser("cache", help="list or remove models in the model cache")
    verbs = p.add_subparsers(dest="verb", required=True)
    for verb, helptext in (("ls", "list the cached models"), ("rm", "remove cached models by address")):
        v = verbs.add_parser(verb, help=helptext)
        where = v.add_mutually_exclusive_group()
        where.add_argument("--config", help="the config whose storage.cache_dir to use")
        where.add_argument("--dir", help="the cache folder (default: the XDG cache folder)")
        if verb == "rm":
            v.add_argument("addresses", nargs="*", help="addresses as written in the config")
            v.add_argument("--all", action="store_true", help="remove every cached model")
        v.set_defaults(func=run)


def _cache_root(args: argparse.Namespace) -> Path:
    from backends.sources.spec import StorageSpec

    if args.config:
        return load_config(args.config).storage.root
    return StorageSpec(cache_dir=args.dir).root


def run(args: argparse.Namespace) -> int:
    from backends.sources.cache import Cache

    cache = Cache(_cache_root(args))
    entries = cache.entries()
    if args.verb == "ls":
        for m in entries:
            fetched = time.strftime("%Y-%m-%d %H:%M", time.gmtime(m.fetched_at))
            sys.stdout.write(
                f"{m.address}\t{m.revision[:12]}\t{len(m.files)} files\t{m.size / 1e6:.1f} MB\t{fetched}\t"
                f"{cache.snapshot_path(m)}\n"
            )
        sys.stdout.write(f"{len(entries)} cached models, {sum(m.size for m in entries) / 1e6:.1f} MB in {cache.root}\n")
        return 0
    if not args.all and not args.addresses:
        raise ConfigError("cache rm: name the addresses to remove, or --all")
    chosen = entries if args.all else [m for m in entries if m.address in args.addresses]
    missing = set(args.addresses) - {m.address for m in chosen}
    if missing:
        raise ConfigError(f"cache rm: not in {cache.root}: {', '.join(sorted(missing))} (see `fleetgate cache ls`)")
    freed = cache.remove(chosen)
    sys.stdout.write(f"removed {len(chosen)} cached models, {freed / 1e6:.1f} MB freed\n")
    return 0
