"""The remote backend's upstream client side by side: checkouts that differ in it, measured interleaved.

Each `--tree label=path` is a checkout (e.g. `git worktree add /tmp/httpx <commit>`): the commit
before the move to aiohttp (httpx), the move itself (aiohttp), and optionally the last commit with the
own HTTP/1.1 client (bc1f8af). Every round runs `bench_policy_proxy --rounds 1` of each checkout in
turn, the order rotated every round, each checkout's own script with the checkout as working directory
and `PYTHONPATH` (bench_house_compare's `Tree`: imports checked first). LiteLLM is left out where the
script allows it (`--no-litellm`), and never installed here (`PIP_NO_INDEX`: a checkout without that
flag skips it with a note).

Reported per figure (fleetgate with nothing to enforce, and with SQLite limits, at c=1 and c=16;
req/s, p50 and the gateway process's CPU a request), per checkout: the median over rounds and its
spread; and each checkout's median over the first checkout's (`--base`), with the per-round ratios.
The upstream's own req/s is the within-run control (code all checkouts share).

Run: `.venv/bin/python -m bench.bench_upstream_client --tree httpx=/tmp/a --tree aiohttp=/tmp/b
[--tree own=/tmp/c] [--rounds 3 --seconds 2]`. Writes bench/results/upstream_client.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.bench_house_compare import Tree, check_imports
from bench.servers import ROOT

RESULTS = ROOT / "bench" / "results"
SERVERS = ("fleetgate_no_policy", "fleetgate_sqlite", "upstream")
CONCURRENCY = ("c1", "c16")
METRICS = ("rps", "p50_ms", "cpu_ms_per_req")


def run_once(tree: Tree, seconds: float) -> dict[str, Any]:
    """One round of the tree's own bench_policy_proxy; its points for the servers compared here."""
    script = tree.path / "bench" / "bench_policy_proxy.py"
    extra = ["--no-litellm", "--out", "upstream_client_round"] if "--no-litellm" in script.read_text() else []
    name = "upstream_client_round" if extra else "policy_proxy"
    subprocess.run(
        tree.script("bench_policy_proxy", "--rounds", "1", "--seconds", f"{seconds:g}", *extra),
        cwd=tree.path, env=tree.env(PIP_NO_INDEX="1"), check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    report = json.loads((tree.path / "bench" / "results" / f"{name}.json").read_text())
    points = report["per_round"][0]
    return {s: {c: {m: points[s][c][m] for m in METRICS if m in points[s][c]} for c in CONCURRENCY} for s in SERVERS}


def summarize(rounds: list[dict[str, Any]], labels: list[str], base: str) -> dict[str, Any]:
    """Per figure and checkout: median, spread, and the median and per-round ratios over `base`."""
    table: dict[str, Any] = {}
    for server in SERVERS:
        for c in CONCURRENCY:
            for metric in METRICS:
                values = {t: [r[t][server][c].get(metric) for r in rounds] for t in labels}
                if any(v is None for vs in values.values() for v in vs):
                    continue
                row: dict[str, Any] = {}
                for t in labels:
                    row[t] = {
                        "median": round(statistics.median(values[t]), 4),
                        "range": [round(min(values[t]), 4), round(max(values[t]), 4)],
                    }
                    if t != base:
                        row[t]["over_" + base] = round(row[t]["median"] / row[base]["median"], 3)
                        per_round = [a / b for a, b in zip(values[t], values[base], strict=True) if b]
                        row[t]["per_round_over_" + base] = [round(x, 3) for x in per_round]
                table[f"{server}.{c}.{metric}"] = row
    return table


def plot(report: dict[str, Any], path: Path) -> None:
    from bench import plotting

    labels: list[str] = report["trees"]
    fig, axes = plotting.figure(1, 2, size=(11, 4.2))
    for ax, metric, title in ((axes[0], "cpu_ms_per_req", "gateway CPU a request (ms)"), (axes[1], "rps", "req/s")):
        groups = [f"{s.removeprefix('fleetgate_')} {c}" for s in SERVERS[:2] for c in CONCURRENCY]
        series = {t: [report["figures"][f"{s}.{c}.{metric}"][t]["median"] for s in SERVERS[:2] for c in CONCURRENCY]
                  for t in labels}  # fmt: skip
        plotting.grouped_bars(ax, groups, series, fmt="{:.2f}" if metric != "rps" else "{:.0f}")
        ax.set_title(f"{title}, medians of {report['rounds']} interleaved rounds", fontsize=9)
        ax.legend(fontsize=8)
    plotting.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--tree", action="append", required=True, help="label=path of a checkout (2 or more)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "upstream_client.json")
    args = parser.parse_args()
    trees = [Tree(label, Path(path).resolve()) for label, _, path in (t.partition("=") for t in args.tree)]
    labels = [t.label for t in trees]
    imports = {t.label: check_imports(t) for t in trees}
    started, load_before = time.perf_counter(), os.getloadavg()
    rounds: list[dict[str, Any]] = []
    for index in range(args.rounds):
        order = trees[index % len(trees) :] + trees[: index % len(trees)]
        if index % 2:
            order.reverse()
        result: dict[str, Any] = {"order": [t.label for t in order]}
        for tree in order:
            result[tree.label] = run_once(tree, args.seconds)
            sys.stderr.write(f"round {index + 1} {tree.label} done at {time.perf_counter() - started:.0f} s\n")
        rounds.append(result)
        args.out.with_suffix(".tmp").write_text(json.dumps(rounds))  # kept as it goes
    report = {
        "benchmark": "bench_upstream_client",
        "what": (__doc__ or "").split("\n\n")[0],
        "trees": labels,
        "commits": {t.label: t.commit() for t in trees},
        "imports_checked": imports,
        "rounds": args.rounds,
        "seconds_per_point": args.seconds,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_before_after": [load_before, os.getloadavg()]},  # fmt: skip
        "figures": summarize(rounds, labels, labels[0]),
        "per_round": rounds,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".tmp").unlink(missing_ok=True)
    plot(report, args.out.with_suffix(".png"))
    for key, row in report["figures"].items():
        cells = "  ".join(f"{t} {row[t]['median']:9.3f}" + (f" ({row[t]['over_' + labels[0]]:.2f}x)" if t != labels[0] else "")
                          for t in labels)  # fmt: skip
        sys.stdout.write(f"{key:40s} {cells}\n")


if __name__ == "__main__":
    main()
