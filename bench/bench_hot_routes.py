"""The hot routes (gateway/hot_routes.py) on against off: two gateways side by side, in one run.

Each pair is the same `fleetgate serve` config started twice, once with `FLEETGATE_HOT_ROUTES=off`
(every request through Litestar's router, dependencies and signature model) and once with the
default (the inference routes matched ahead of it):
  - tensors: bench_tensor_peers' heavy MLP (512 -> 4096 -> 4096 -> 10) on ONNX Runtime with its
    batching config, one-row JSON v2 bodies, bench_gateway's closed-loop keep-alive client at c=1
    and c=32 (requests/s and p50);
  - chat: bench_policy_proxy's OpenAI chat proxy with the full tenant path on SQLite state in front
    of its minimal upstream, wrk at c=1 and c=16 (requests/s, p50 and the gateway's CPU a request).
Within a round the two gateways of a pair are measured back to back, in alternating order from round
to round; ratios on / off are taken within a round and their medians reported.

Writes bench/results/hot_routes.json and .png. Run: `.venv/bin/python -m bench.bench_hot_routes [--rounds 6]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from bench import bench_policy_proxy as chat
from bench import bench_tensor_peers as tensors
from bench.bench_gateway import RESULTS, _load, build_model, start_gateway, summarize
from bench.servers import ROOT, stop

SWITCH = {"off": {"FLEETGATE_HOT_ROUTES": "off"}, "on": {}}


def start_tensor_pair(tmp: Path, stack: ExitStack) -> dict[str, tuple[int, bytes]]:
    model = tmp / "mlp.onnx"
    build_model(model, tensors.D_IN, tensors.HIDDEN)
    row = np.random.default_rng(1).standard_normal((1, tensors.D_IN), np.float32)
    pair = {}
    for name, env in SWITCH.items():
        config = lambda p: tensors.GATEWAY_CONFIG.format(port=p, model=model, options="")  # noqa: E731
        proc, port, key = start_gateway(tmp, config, env=env)
        stack.callback(stop, proc, False)
        pair[name] = (port, tensors.raw_request(port, tensors.request_specs(key, row)["fleetgate"]))
    return pair


def start_chat_pair(tmp: Path, stack: ExitStack) -> tuple[dict[str, chat.Server], int]:
    upstream_port = chat.free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_policy_proxy", "--upstream", str(upstream_port)], cwd=ROOT
    )
    stack.callback(chat.stop, upstream)
    chat.wait_until(lambda: chat.port_open(upstream_port), upstream, "upstream", 10)
    pair = {}
    for name, env in SWITCH.items():
        fill = dict(state=f"sqlite:///{tmp / name}.db", upstream=upstream_port, model=chat.MODEL)
        proc, port, key = start_gateway(
            tmp, lambda p, fill=fill: chat.GATEWAY_YAML.format(port=p, **fill), env=env
        )
        stack.callback(chat.stop, proc)
        pair[name] = chat.Server(f"chat_{name}", port, key, [proc.pid])
        chat.check_answer(pair[name])
    return pair, upstream_port


def one_round(
    index: int, tensor_pair: dict, chat_pair: dict, upstream: int, tmp: Path, seconds: float
) -> dict:
    order = ["off", "on"] if index % 2 == 0 else ["on", "off"]
    result: dict[str, Any] = {"order": order}
    for c in (1, 32):
        for name in order:
            port, request = tensor_pair[name]
            asyncio.run(_load(port, request, c, 0.5))  # warm the connections
            latencies, errors, elapsed = asyncio.run(_load(port, request, c, seconds))
            result.setdefault(f"tensors_{name}", {})[f"c{c}"] = summarize(latencies, elapsed) | {
                "errors": len(errors)
            }
    for c in chat.CONCURRENCY:
        for name in order:
            result.setdefault(f"chat_{name}", {})[f"c{c}"] = chat.run_wrk(
                chat_pair[name], c, seconds, tmp, upstream
            )
    return result


def ratios(rounds: list[dict]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    points = [("tensors", c, m) for c in ("c1", "c32") for m in ("rps", "p50_ms")]
    points += [("chat", c, m) for c in ("c1", "c16") for m in ("rps", "p50_ms", "cpu_ms_per_req")]
    for kind, c, metric in points:
        per_round = [r[f"{kind}_on"][c][metric] / r[f"{kind}_off"][c][metric] for r in rounds]
        out[f"{kind}_{c}_{metric}_on_over_off"] = {
            "median": round(statistics.median(per_round), 3),
            "per_round": [round(x, 3) for x in per_round],
        }
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench import plotting  # bench/plotting.py: the footer with the date and machine

    keys = [k for k in report["ratios"] if k.endswith("rps_on_over_off") or "p50" in k]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    values = [report["ratios"][k]["median"] for k in keys]
    bars = ax.bar(range(len(keys)), values, color=["C0" if "rps" in k else "C1" for k in keys])
    ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    labels = [k.removesuffix("_on_over_off").replace("_", " ") for k in keys]
    ax.set_xticks(range(len(keys)), labels, rotation=20, fontsize=8)
    ax.set_title(f"hot routes on / off (median of {report['rounds']} rounds; req/s blue, p50 orange)")
    fig.tight_layout()
    plotting.save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name, ExitStack() as stack:
        tmp = Path(name)
        tensor_pair = start_tensor_pair(tmp, stack)
        chat_pair, upstream = start_chat_pair(tmp, stack)
        rounds = []
        for index in range(args.rounds):
            rounds.append(one_round(index, tensor_pair, chat_pair, upstream, tmp, args.seconds))
            print(
                json.dumps(
                    {
                        k: {c: round(p["rps"]) for c, p in v.items()}
                        for k, v in rounds[-1].items()
                        if k != "order"
                    }
                )
            )
    report = {
        "benchmark": "bench_hot_routes",
        "method": (__doc__ or "").split("\n\n", 1)[1],
        "seconds_per_point": args.seconds,
        "rounds": args.rounds,
        "ratios": ratios(rounds),
        "per_round": rounds,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "hot_routes.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report, RESULTS / "hot_routes.png")
    print(json.dumps({k: v["median"] for k, v in report["ratios"].items()}, indent=1))


if __name__ == "__main__":
    main()
