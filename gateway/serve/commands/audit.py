"""`fleetgate audit --config FILE [--since] [--until] [--actor] [--action] [--limit N] [--json]`:
the audit trail of admin changes from the config's state store, newest first.

Also where the CLI's own changes are recorded (`record_cli_change`: `keys create` and `keys
revoke`), as `cli:<os user>` from `local`.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
from datetime import UTC, datetime
from typing import Any

import msgspec

from gateway.config import Config, ConfigError, load_config
from gateway.serve.commands.base import AddParser
from policies.audit import MAX_PAGE, AuditEntry, AuditLog, parse_when


def register(add_parser: AddParser) -> None:
    p = add_parser("audit", help="who changed what: the admin audit trail, newest first")
    p.add_argument("--config", required=True)
    p.add_argument("--since", help="ISO time or epoch seconds")
    p.add_argument("--until", help="ISO time or epoch seconds")
    p.add_argument("--actor", help="admin-key:<id>, cli:<user>, signal:SIGHUP, a token's subject")
    p.add_argument("--action", help="keys, keys.create, config.reload, adapters, canary, budgets...")
    p.add_argument("--limit", type=int, default=100, help=f"entries to print (1..{MAX_PAGE})")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of columns")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if not 1 <= args.limit <= MAX_PAGE:
        raise ConfigError(f"--limit must be within 1..{MAX_PAGE}")
    since, until = _time(args.since, "--since"), _time(args.until, "--until")

    async def read(trail: AuditLog) -> int:
        page = await trail.query(since=since, until=until, actor=args.actor, action=args.action, limit=args.limit)
        if not args.json:
            print("when\tactor\tvia\tclient\taction\ttarget\tbefore\tafter")
        for entry in page.entries:
            print(msgspec.json.encode(entry).decode() if args.json else _columns(entry))
        return 0

    return asyncio.run(_with_trail(config, read))


async def record_cli_change(config: Config, action: str, target: str | None, *, before: Any = None, after: Any = None) -> None:
    """Append a change the CLI made to the audit trail, as `cli:<os user>` from `local`."""

    async def append(trail: AuditLog) -> int:
        await trail.append(
            actor=f"cli:{_user()}", action=action, target=target, before=before, after=after, client="local", via="cli"
        )
        return 0

    await _with_trail(config, append)


async def _with_trail(config: Config, work: Any) -> int:
    from policies.stores import open_store

    if config.state.url.startswith("memory://"):
        raise ConfigError("the state is memory:// (it lives inside the server process): read GET /admin/audit")
    store = await open_store(config.state.url)
    try:
        return await work(AuditLog(store))
    finally:
        await store.close()


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a bare container)
        return f"uid{os.getuid()}"


def _time(value: str | None, option: str) -> float | None:
    if value is None:
        return None
    try:
        return parse_when(value)
    except ValueError:
        raise ConfigError(f"{option} {value!r}: use an ISO time (2027-01-31T00:00:00Z) or epoch seconds") from None


def _columns(entry: AuditEntry) -> str:
    def compact(value: Any) -> str:
        return "-" if value is None else msgspec.json.encode(value).decode()

    when = datetime.fromtimestamp(entry.at, UTC).isoformat(timespec="seconds")
    fields = (when, entry.actor, entry.via, entry.client or "-", entry.action, entry.target or "-")
    return "\t".join((*fields, compact(entry.before), compact(entry.after)))
