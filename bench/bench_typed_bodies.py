"""OpenAI chat through Litestar's typed bodies vs the gateway's own raw body reads, side by side.

Two checkouts, `--before` (the raw reads: handlers read the ASGI channel and decode with msgspec) and
`--after` (this one: `data: ChatBody` decoded by Litestar after a key guard and a deadline-bound
body read, gateway/http/bodies.py), each serving the same config in its own `fleetgate serve`
process in front of bench_policy_proxy's upstream (a canned completion at once). Two configs per
checkout: `no_policy` (state in memory, no limits: what the HTTP stack and core cost) and `sqlite`
(bench_policy_proxy's policy tenant on SQLite: the whole request path). wrk at c=1 and c=16, the
order of the servers rotated each round; the JSON has every round, medians and after/before ratios.

    .venv/bin/python -m bench.bench_typed_bodies --before /tmp/before [--seconds 3 --rounds 3]

Writes bench/results/typed_bodies.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

from bench.bench_gateway import ADMIN_KEY, RESULTS
from bench.bench_policy_proxy import (
    GATEWAY_YAML,
    MODEL,
    OPEN_GATEWAY_YAML,
    Server,
    free_port,
    port_open,
    run_wrk,
    stop,
    wait_until,
)
from bench.servers import ROOT


def start_tree_gateway(tree: Path, work: Path, name: str, yaml: str, fill: dict[str, object]) -> tuple[subprocess.Popen[bytes], Server]:
    """`fleetgate serve` run from `tree` (its code, not this checkout's), with a key of tenant `bench`."""
    port = free_port()
    config = work / f"{name}.yaml"
    config.write_text(yaml.format(port=port, **fill))
    env = {**os.environ, "PYTHONPATH": str(tree), "FLEETGATE_GRPC_PORT": "off", "FLEETGATE_ADMIN_KEY": ADMIN_KEY}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gateway.serve.cli", "serve", "--config", str(config)],
        cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=(work / f"{name}.log").open("wb"),
    )  # fmt: skip
    wait_until(lambda: port_open(port), proc, name, 120)
    deadline = time.monotonic() + 120
    while httpx.get(f"http://127.0.0.1:{port}/health/ready").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not ready")
        time.sleep(0.2)
    r = httpx.post(f"http://127.0.0.1:{port}/admin/keys", json={"tenant": "bench"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    r.raise_for_status()
    return proc, Server(name, port, r.json()["key"], [proc.pid])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, default=ROOT)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rounds: list[dict[str, dict[str, dict[str, float]]]] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        work = Path(tmp)
        up = free_port()
        upstream = subprocess.Popen([sys.executable, "-m", "bench.bench_policy_proxy", "--upstream", str(up)], cwd=ROOT)
        stack.callback(stop, upstream)
        wait_until(lambda: port_open(up), upstream, "upstream", 10)
        servers: list[Server] = []
        for label, tree in (("before", args.before), ("after", args.after)):
            for config, yaml, state in (("no_policy", OPEN_GATEWAY_YAML, "memory://"), ("sqlite", GATEWAY_YAML, None)):
                state = state or f"sqlite:///{work / (label + '.db')}"
                proc, server = start_tree_gateway(tree, work, f"{label}_{config}", yaml, {"state": state, "upstream": up, "model": MODEL})
                stack.callback(stop, proc)
                servers.append(server)
        for i in range(args.rounds):
            order = servers[i % len(servers):] + servers[: i % len(servers)]
            point = {s.name: {f"c{c}": run_wrk(s, c, args.seconds, work, up) for c in (1, 16)} for s in order}
            for name, per_c in point.items():
                print(f"round {i} {name:18s} " + "  ".join(f"{c} rps={r['rps']:7.1f} p50={r['p50_ms']:6.3f}ms cpu/req={r['cpu_ms_per_req']:5.3f}ms non2xx={r['non_2xx']}" for c, r in per_c.items()), flush=True)  # fmt: skip
            rounds.append(point)
    medians = {
        name: {c: {m: statistics.median(r[name][c][m] for r in rounds) for m in ("rps", "p50_ms", "p99_ms", "cpu_ms_per_req")} for c in ("c1", "c16")}
        for name in rounds[0]
    }  # fmt: skip
    ratios = {
        f"{config}.{c}.{m}": medians[f"after_{config}"][c][m] / medians[f"before_{config}"][c][m]
        for config in ("no_policy", "sqlite") for c in ("c1", "c16") for m in ("rps", "p50_ms", "cpu_ms_per_req")
    }  # fmt: skip
    report = {
        "benchmark": "bench_typed_bodies",
        "what": (__doc__ or "").split("\n\n")[0],
        "seconds_per_point": args.seconds,
        "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count()},
        "points": medians,
        "after_over_before": ratios,
        "per_round": rounds,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "typed_bodies.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
