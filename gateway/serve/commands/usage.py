"""`fleetgate usage --config FILE [--tenant T]`: usage and spend per tenant, model and period, from the
state store (spend in USD at the prices configured when each request was settled)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from gateway.config import load_config
from gateway.serve.commands.base import AddParser
from gateway.serve.commands.store import check_tenant, with_store


def register(add_parser: AddParser) -> None:
    p = add_parser("usage", help="usage and spend per tenant, model and period (or per key)")
    p.add_argument("--config", required=True)
    p.add_argument("--tenant")
    p.add_argument("--by-key", action="store_true", help="per key, model, deployment and period")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    check_tenant(config, args.tenant)

    async def report(_: Any, admission: Any) -> int:
        if args.by_key:
            print("tenant\tkey\tmodel\tdeployment\tperiod\trequests\ttokens\tcost_usd")
            for r in await admission.key_usage(args.tenant):
                print(
                    f"{r.tenant}\t{r.key_id}\t{r.model}\t{r.deployment}\t{r.period}\t{r.requests}\t{r.tokens}"
                    f"\t{r.cost_usd:.6f}"
                )
            return 0
        rows = await admission.usage(args.tenant)
        print("tenant\tmodel\tperiod\trequests\ttokens\tcost_usd")
        for row in rows:
            print(f"{row.tenant}\t{row.model}\t{row.period}\t{row.requests}\t{row.tokens}\t{row.cost_usd:.6f}")
        return 0

    return asyncio.run(with_store(config, report))
