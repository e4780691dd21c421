"""A batched deployment's lone requests run on the event loop's thread or on a worker
(`inline_alone_below_us`), side by side in one run.

Two `fleetgate serve` processes serve bench_tensor_peers' heavy MLP (512 -> 4096 -> 4096 -> 10 fp32,
a one-row run under 5 ms on ONNX Runtime) with `batching: {max_batch_size: 64, max_delay_ms: 2}`,
one with the default `inline_alone_below_us: 5000` (a request that finds nothing of its deployment
running or queued runs inline) and one with `0` (every run goes to a worker thread, as before the
option existed). One-row JSON v2 bodies, bench_gateway's closed-loop keep-alive client at c = 1, 2,
4, 8 and 32; within a round the two gateways run each point back to back, the first alternating between
rounds. Reported: medians over rounds of requests/s, p50 and p99, and the ratios inline / worker
taken within each round (median and per round). c >= 2 shows what the rule must not cost: callers
that overlap form batches, which run on workers in both gateways; and at c=2 a request that arrives
while another runs inline is read only after that run, finds nothing running and may run inline
too, so two callers can take turns on the loop's thread instead of sharing the runtime's two slots.
The inline gateway's rule in full: with batching, a request that finds nothing queued and a slot
free, after 8 single-request batches in a row, runs inline while the median of the last 16 runs is
under 5 ms, none took over 10 ms and its input is no larger than theirs.

Writes bench/results/lone_inline.json and .png. Run: `.venv/bin/python -m bench.bench_lone_inline
[--seconds 3 --rounds 5]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_gateway import start_gateway
from bench.bench_tensor_peers import (
    D_IN,
    GATEWAY_CONFIG,
    HIDDEN,
    build_model,
    raw_request,
    request_specs,
    run_point,
)
from bench.servers import stop

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
MODES = {"inline": 5000, "worker": 0}  # inline_alone_below_us
CONCURRENCY = (1, 2, 4, 8, 32)


def ratios(rounds: list[dict[str, Any]], key: str, metric: str) -> dict[str, Any]:
    values = [round(r["inline"][key][metric] / r["worker"][key][metric], 3) for r in rounds]
    return {"median": round(statistics.median(values), 3), "per_round": values}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench import plotting  # bench/plotting.py: the footer with the date and machine

    med = report["median"]
    xs = np.arange(len(CONCURRENCY))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, mode in enumerate(MODES):
        label = f"{mode} (inline_alone_below_us: {MODES[mode]})"
        axes[0].bar(
            xs + (i - 0.5) * 0.4, [med[mode][f"c{c}"]["p50_ms"] for c in CONCURRENCY], 0.4, label=label
        )
        axes[1].bar(xs + (i - 0.5) * 0.4, [med[mode][f"c{c}"]["rps"] for c in CONCURRENCY], 0.4, label=label)
    for ax, title in zip(axes, ("p50 latency (ms)", "requests/s"), strict=True):
        ax.set_xticks(xs, [f"c={c}" for c in CONCURRENCY])
        ax.set_title(f"{title}, median of {report['rounds']} rounds")
        ax.legend(fontsize=8)
    fig.suptitle(f"Lone requests inline vs on a worker: MLP {D_IN}-{HIDDEN}-{HIDDEN}-10, batching on")
    fig.tight_layout()
    plotting.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per point")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-lone-") as tmp, ExitStack() as stack:
        model = Path(tmp) / "mlp.onnx"
        build_model(model, D_IN, HIDDEN)
        row = np.random.default_rng(1).standard_normal((1, D_IN), np.float32)
        targets: dict[str, tuple[int, bytes]] = {}
        for mode, alone in MODES.items():
            workdir = Path(tmp) / mode
            workdir.mkdir()
            proc, port, key = start_gateway(
                workdir,
                lambda p, alone=alone: GATEWAY_CONFIG.format(
                    port=p, model=model, options=f", options: {{inline_alone_below_us: {alone}}}"
                ),
            )
            stack.callback(stop, proc, False)
            targets[mode] = (port, raw_request(port, request_specs(key, row)["fleetgate"]))
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = list(MODES) if r % 2 == 0 else list(MODES)[::-1]
            result: dict[str, Any] = {"order": order}
            for c in CONCURRENCY:
                for mode in order:
                    point = run_point(*targets[mode], c, args.seconds)
                    result.setdefault(mode, {})[f"c{c}"] = point
                    print(
                        f"round {r + 1} {mode:6s} c={c:<2d} {point['rps']:7.1f} req/s "
                        f"p50 {point['p50_ms']:6.2f} ms p99 {point['p99_ms']:6.2f} ms",
                        file=sys.stderr,
                    )
            rounds.append(result)
    median = {
        mode: {
            f"c{c}": {
                m: round(statistics.median(r[mode][f"c{c}"][m] for r in rounds), 3)
                for m in ("rps", "p50_ms", "p99_ms", "errors")
            }
            for c in CONCURRENCY
        }
        for mode in MODES
    }
    report = {
        "benchmark": "bench_lone_inline",
        "method": __doc__.split("\n\n", 1)[1],
        "modes_inline_alone_below_us": MODES,
        "seconds_per_point": args.seconds,
        "rounds": args.rounds,
        "median": median,
        "inline_over_worker": {
            f"c{c}": {"p50": ratios(rounds, f"c{c}", "p50_ms"), "rps": ratios(rounds, f"c{c}", "rps")}
            for c in CONCURRENCY
        },
        "per_round": rounds,
        "machine": {"cpu_count": os.cpu_count(), "loadavg": os.getloadavg()},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "lone_inline.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    print(json.dumps(report["inline_over_worker"], indent=1))


if __name__ == "__main__":
    main()
