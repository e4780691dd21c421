"""`fleetgate keys create|list|revoke --config FILE`: tenant API keys in the config's state store.

A key's secret is printed once (or kept in a 0600 file with `--secret-file`); the store holds only
its hash.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.config import ConfigError, load_config
from gateway.serve.commands.audit import record_cli_change
from gateway.serve.commands.base import AddParser, fail
from gateway.serve.commands.store import check_tenant, with_store
from policies.types import Budget, Limits


def register(add_parser: AddParser) -> None:
    p = add_parser("keys", help="create, list or revoke tenant API keys")
    keys = p.add_subparsers(dest="action", required=True)
    k = keys.add_parser("create", help="create a key; prints the secret alone on stdout, once")
    k.add_argument("--config", required=True)
    k.add_argument("--tenant", required=True)
    k.add_argument("--models", nargs="*", help="model globs the key is restricted to")
    k.add_argument("--expires", help="ISO time or a duration like 30d / 12h")
    k.add_argument("--name")
    _policy_arguments(k)
    k.add_argument(
        "--secret-file",
        help="keep the secret in this file (mode 0600) and print it again, without creating a key, "
        "while it is an active key of the tenant (what `make run` does with var/demo-key)",
    )
    k.set_defaults(func=run)
    k = keys.add_parser("list", help="list keys (never their secrets)")
    k.add_argument("--config", required=True)
    k.add_argument("--tenant")
    k.set_defaults(func=run)
    k = keys.add_parser("revoke", help="revoke a key on every replica")
    k.add_argument("--config", required=True)
    k.add_argument("key_id")
    k.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.action == "list":
        check_tenant(config, args.tenant)

    async def create(keys: Any, _: Any) -> int:
        kept = Path(args.secret_file) if args.secret_file else None
        if kept is not None:
            reused = await _valid_kept_secret(keys, kept, args.tenant)
            if reused is not None:
                print(reused)
                return 0
        try:
            record, secret = await keys.create(
                args.tenant, args.models or None, _parse_expiry(args.expires), args.name,
                limits=_from_options(args, _LIMIT_OPTIONS, Limits),
                budget=_from_options(args, _BUDGET_OPTIONS, Budget),
            )  # fmt: skip
        except ValueError as exc:
            return fail(str(exc))
        await record_cli_change(config, "keys.create", record.key_id, after=record)
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
                + _policy_text(r)
            )
        return 0

    async def revoke(keys: Any, _: Any) -> int:
        was_active = await keys.still_valid(args.key_id)
        if not await keys.revoke(args.key_id):
            return fail(f"no key {args.key_id!r}")
        change = {"before": {"active": was_active}, "after": {"active": False}}
        await record_cli_change(config, "keys.revoke", args.key_id, **change)
        print(f"revoked {args.key_id}")
        return 0

    action = {"create": create, "list": list_, "revoke": revoke}[args.action]
    return asyncio.run(with_store(config, action))


#: the key's own limits and budget: (option, field of Limits or Budget)
_LIMIT_OPTIONS = (
    ("--requests-per-minute", "requests_per_minute"),
    ("--tokens-per-minute", "tokens_per_minute"),
    ("--max-concurrency", "max_concurrency"),
)
_BUDGET_OPTIONS = (("--budget-usd-per-day", "usd_per_day"), ("--budget-usd-per-month", "usd_per_month"))


def _policy_arguments(k: argparse.ArgumentParser) -> None:
    for option, field in _LIMIT_OPTIONS:
        k.add_argument(option, dest=field, type=int, help=f"the key's own {field} (beside its tenant's)")
    for option, field in _BUDGET_OPTIONS:
        k.add_argument(option, dest=field, type=float, help=f"the key's own budget, {field} (beside its tenant's)")


def _from_options(args: argparse.Namespace, options: tuple[tuple[str, str], ...], kind: type) -> Any:
    """A key's Limits or Budget from the options given (None when none was)."""
    values = {f: getattr(args, f) for _, f in options if getattr(args, f) is not None}
    try:
        return kind(**values) if values else None
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _policy_text(record: Any) -> str:
    """The key's own limits and budget as `\tfield=value` columns (nothing when it has none)."""
    parts = [
        f"{name}={value}"
        for spec in (record.limits, record.budget)
        if spec is not None
        for name in spec.__struct_fields__
        if (value := getattr(spec, name)) is not None
    ]
    return "".join(f"\t{p}" for p in parts)


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
