"""Admission in process: what one request's admit and settle cost under the lease strategy, per checkout.

No HTTP and no upstream: `Admission.admit_at_once` (or `admit` when the slices fall short) and
`reconcile_at_once` (or `reconcile`) in a loop on one event loop, the way the gateway calls them, for
  every_policy   the tenant of `bench_policy_proxy` (request, token and concurrency limits, day and
                 month quotas, per-key limits, all too high to refuse), state in SQLite, leases on;
  nothing        a tenant with nothing to check (usage recorded with the lease batch).
Each request reserves 25 tokens and uses 16 (so every settle refunds). The loop yields to the event
loop every 20 requests (the ticks run then, outside the timed calls). Reported: microseconds a
request for the admit and for the settle, the median of `--samples` batches of `--requests`.

Each checkout (`--checkout name=path`, default this one) is measured in a child interpreter that
imports that checkout's code; children alternate over `--rounds` so that the machine's drift falls
on all alike. The figures to compare: each checkout's every_policy over its own nothing, and each
checkout's every_policy over the first checkout's (admit + settle, the median of per-round ratios).

    .venv/bin/python -m bench.bench_admission [--checkout before=/tmp/before --checkout after=.]

Writes bench/results/admission.json and .png (`--out` names them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
TENANTS = ("every_policy", "nothing")


async def _measure(requests: int, samples: int) -> dict[str, dict[str, float]]:
    """In the child: the median microseconds a request to admit and to settle, per tenant."""
    from policies.admission import Admission
    from policies.leases import LeaseSettings
    from policies.principal import Principal
    from policies.stores import open_store
    from policies.types import Limits, Quotas, TenantSpec

    big = 10**12
    every = TenantSpec(
        limits=Limits(requests_per_minute=10**7, tokens_per_minute=10**9, max_concurrency=100_000),
        quotas=Quotas(tokens_per_day=big, tokens_per_month=big, requests_per_day=big, requests_per_month=big),
        key_limits=Limits(requests_per_minute=10**7, tokens_per_minute=10**9),
    )
    with tempfile.TemporaryDirectory() as tmp:
        store = await open_store(f"sqlite:///{tmp}/state.db")
        adm = Admission(store, {"every_policy": every, "nothing": TenantSpec()}, time.time, leases=LeaseSettings())
        callers = {t: Principal(t, f"{i:012x}", ("*",)) for i, t in enumerate(TENANTS)}

        async def batch(who: Principal, n: int) -> tuple[float, float]:
            admit_s = settle_s = 0.0
            for i in range(n):
                t0 = time.perf_counter()
                r = adm.admit_at_once(who, "m", 25) or await adm.admit(who, "m", 25)
                t1 = time.perf_counter()
                if not adm.reconcile_at_once(r, 16):
                    await adm.reconcile(r, 16)
                settle_s += time.perf_counter() - t1
                admit_s += t1 - t0
                if i % 20 == 0:
                    await asyncio.sleep(0.0005)
            return admit_s / n * 1e6, settle_s / n * 1e6

        for who in callers.values():  # warm-up: slices taken, rates observed
            await batch(who, requests // 2)
        runs: dict[str, list[tuple[float, float]]] = {t: [] for t in TENANTS}
        for _ in range(samples):
            for tenant, who in callers.items():
                runs[tenant].append(await batch(who, requests))
        await adm.close()
    return {
        t: {"admit_us": statistics.median(a for a, _ in v), "settle_us": statistics.median(s for _, s in v)}
        for t, v in runs.items()
    }


def _child(path: Path, requests: int, samples: int) -> dict[str, dict[str, float]]:
    """This script, run in a child interpreter that imports `path`'s policies (checked: it says where from)."""
    env = {**os.environ, "PYTHONPATH": str(path)}
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--requests", str(requests), "--samples", str(samples)],
        cwd=path, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    found = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(found.pop("policies_from")).is_relative_to(path):
        raise SystemExit(f"the child for {path} imported another checkout's policies")
    return found


def _plot(report: dict, path: Path) -> None:
    from bench.plotting import figure, grouped_bars, save

    names = list(report["medians"])
    fig, ax = figure(size=(8, 4))
    series = {
        f"{t} ({part})": [report["medians"][n][t][f"{part}_us"] for n in names]
        for t in TENANTS
        for part in ("admit", "settle")
    }
    grouped_bars(ax, names, series, fmt="{:.1f}")
    ax.set_ylabel("us a request (median)")
    ax.set_title("admission in process under leases: admit and settle, per checkout")
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--checkout", action="append", default=[], help="name=path (repeatable; default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--out", default="admission")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import policies

        found = asyncio.run(_measure(args.requests, args.samples))
        print(json.dumps({**found, "policies_from": str(Path(policies.__file__).resolve())}))
        return
    checkouts = dict(c.split("=", 1) for c in args.checkout) or {"this": str(ROOT)}
    rounds: list[dict] = []
    for r in range(args.rounds):
        order = list(checkouts) if r % 2 == 0 else list(checkouts)[::-1]
        rounds.append({name: _child(Path(checkouts[name]).resolve(), args.requests, args.samples) for name in order})
        print(f"round {r}: {json.dumps(rounds[-1])}", flush=True)
    medians = {
        n: {t: {k: statistics.median(rd[n][t][k] for rd in rounds) for k in ("admit_us", "settle_us")} for t in TENANTS}
        for n in checkouts
    }
    ratios = {
        f"{n}_every_policy_over_nothing": statistics.median(
            (rd[n]["every_policy"]["admit_us"] + rd[n]["every_policy"]["settle_us"])
            / (rd[n]["nothing"]["admit_us"] + rd[n]["nothing"]["settle_us"])
            for rd in rounds
        )
        for n in checkouts
    }
    first, *others = list(checkouts)
    for n in others:  # each checkout's admit + settle against the first one's, round by round
        ratios[f"{n}_over_{first}_every_policy"] = statistics.median(
            sum(rd[n]["every_policy"].values()) / sum(rd[first]["every_policy"].values()) for rd in rounds
        )
    report = {
        "benchmark": "bench_admission",
        "what": (__doc__ or "").split("\n")[0],
        "checkouts": checkouts,
        "requests": args.requests,
        "samples": args.samples,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "per_round": rounds,
        "medians": medians,
        "ratios": ratios,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{args.out}.json"
    out.write_text(json.dumps(report, indent=1))
    _plot(report, RESULTS / f"{args.out}.png")
    print(json.dumps({"medians": medians, "ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
