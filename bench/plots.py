"""Plots of the benchmarks whose scripts had none, and a redraw of every plot from its saved JSON.

Each `plot_<result>(result, path)` draws one result file (the dict its script writes as JSON); the
scripts call them right after writing their JSON. `python -m bench.plots` redraws every PNG under
bench/results/ from the JSON beside it, without running anything: with the functions here, or the
script's own `plot` where it draws from its JSON; a PNG whose script draws from raw samples the JSON
does not keep (the fairness timelines) gets the date-and-machine footer added to the picture as is.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.plotting import figure, grouped_bars, is_stamped, save

RESULTS = Path(__file__).resolve().parent / "results"

Plot = Callable[[dict[str, Any], Path], None]


def plot_gateway(result: dict[str, Any], path: Path) -> None:
    """ONNX Runtime called directly vs through the gateway (unbatched, batched), requests/s."""
    models = result["models"]
    fig, axes = figure(1, len(models), (5.5 * len(models), 4.5))
    for ax, (name, m) in zip(axes, models.items(), strict=True):
        kinds = ["direct", "gateway_unbatched", "gateway_batched"]
        levels = list(m["results"]["direct"])
        series = {k.replace("_", " "): [m["results"][k][c]["rps"] for c in levels] for k in kinds}
        grouped_bars(ax, [f"concurrency {c[1:]}" for c in levels], series)
        shape = m["model"]
        ax.set_title(f"{name} MLP ({shape['d_in']} -> {shape['hidden']}): requests/s, one row each")
        ax.set_ylabel("requests/s")
    save(fig, path)


def plot_limits(result: dict[str, Any], path: Path) -> None:
    """The policy path per request on each state store: latency and admissions per second."""
    rows = result["results"]
    stores = list(rows)
    fig, (left, right) = figure(1, 2, (11, 4.2))
    grouped_bars(
        left,
        stores,
        {
            "p50": [rows[s]["sequential_path_p50_ms"] for s in stores],
            "p99": [rows[s]["sequential_path_p99_ms"] for s in stores],
        },
        fmt="{:.2f}",
    )
    left.set_title("authenticate + admit + reconcile, one at a time (ms)")
    grouped_bars(right, stores, {"admitted/s": [rows[s]["admitted_per_s"] for s in stores]})
    right.set_title(f"admissions/s at concurrency {rows[stores[0]]['concurrency']}")
    save(fig, path)


def plot_router_recovery(result: dict[str, Any], path: Path) -> None:
    """One of two upstreams killed and restarted, per repetition: restart to ready, and to served again."""
    reps = result["repetitions"]
    fig, ax = figure(size=(8, 4))
    grouped_bars(
        ax,
        [f"run {i + 1}" for i in range(len(reps))],
        {
            "restart to ready (s)": [r["restart_to_ready_s"] for r in reps],
            "ready to served again (s)": [r["recovery_s"] for r in reps],
        },
        fmt="{:.2f}",
    )
    ax.set_ylabel("seconds")
    ax.set_title(
        f"router recovery: {result['requests_failed']} of {result['requests_total']} requests failed "
        f"(breaker: {result['breakers']['failure_threshold']} failures, {result['breakers']['cooldown_s']} s cooldown)"
    )
    save(fig, path)


def plot_runtimes(result: dict[str, Any], path: Path) -> None:
    """The digits model on each runtime: requests/s and p50 at concurrency 1 and 16."""
    rows = result["results"]
    names = list(rows)
    levels = [k for k in rows[names[0]] if k.startswith("concurrency_")]
    fig, (left, right) = figure(1, 2, (13, 4.5))
    grouped_bars(
        left,
        names,
        {c.replace("_", " "): [rows[n].get(c, {}).get("requests_per_s", 0) for n in names] for c in levels},
    )
    left.set_title("requests/s (one row each)")
    grouped_bars(
        right,
        names,
        {c.replace("_", " "): [rows[n].get(c, {}).get("p50_ms", 0) for n in names] for c in levels},
        fmt="{:.2f}",
    )
    right.set_title("p50 latency (ms)")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    save(fig, path)


def plot_http_stack(result: dict[str, Any], path: Path) -> None:
    """httptools + uvloop ("auto") vs h11 + asyncio: requests/s and server CPU per request."""
    summary = result["summary"]
    levels = list(summary)
    fig, (left, right) = figure(1, 2, (11, 4.2))
    stacks = {"httptools + uvloop": "auto", "h11 + asyncio": "h11"}
    grouped_bars(left, levels, {n: [summary[c][f"{k}_rps"] for c in levels] for n, k in stacks.items()})
    left.set_title("requests/s (median of rounds)")
    grouped_bars(
        right,
        levels,
        {n: [summary[c][f"{k}_server_cpu_ms_per_request"] for c in levels] for n, k in stacks.items()},
        fmt="{:.2f}",
    )
    right.set_title("gateway CPU per request (ms)")
    save(fig, path)


def _one_chart(groups: list[str], series: dict[str, list[float]], title: str, path: Path) -> None:
    """One axis of grouped requests/s bars."""
    fig, ax = figure(size=(7, 4))
    grouped_bars(ax, groups, series)
    ax.set_ylabel("requests/s")
    ax.set_title(title)
    save(fig, path)


def plot_workers(result: dict[str, Any], path: Path) -> None:
    """`server.workers` 1 vs 2 on one port: requests/s (median of rounds)."""
    median = result["median"]
    models = list(median)
    series = {
        "1 worker": [median[m]["workers_1_rps"] for m in models],
        "2 workers": [median[m]["workers_2_rps"] for m in models],
    }
    _one_chart(models, series, f"workers 1 vs 2 on a {result.get('cores', '?')}-core machine", path)


def plot_workers_threads(result: dict[str, Any], path: Path) -> None:
    """`server.workers: 2`, runtimes at their default threads (a worker's share of the cores) vs
    every core in each worker: requests/s (median of rounds)."""
    median = result["median"]
    models = list(median)
    series = {
        "a worker's share (default)": [median[m]["share_rps"] for m in models],
        "every core in each worker": [median[m]["every_core_rps"] for m in models],
    }
    title = f"{result['workers']} workers on a {result.get('cores', '?')}-core machine: runtime threads"
    _one_chart(models, series, title, path)


def plot_tracing(result: dict[str, Any], path: Path) -> None:
    """Tracing off vs on vs 10 % sampled: requests/s (median of rounds)."""
    median = result["median"]
    levels = list(median)
    labels = {
        "off_again": "off, measured again",
        "on": "on",
        "on_sampled_10pct": "on, 10 % sampled",
    }
    series = {"off": [median[c]["off_rps"] for c in levels]}
    for name, label in labels.items():
        series[label] = [median[c][name]["rps"] for c in levels]
    _one_chart(levels, series, "OpenTelemetry tracing: cost in throughput", path)


def plot_fuzz(result: dict[str, Any], path: Path) -> None:
    """Answers to the schema fuzzer per operation, by status class (no 5xx is the point)."""
    ops = result["operations"]
    names = list(ops)
    classes = ["2xx", "4xx", "5xx"]
    counts = {
        k: [sum(n for s, n in ops[o]["statuses"].items() if str(s).startswith(k[0])) for o in names]
        for k in classes
    }
    fig, ax = figure(size=(10, 0.3 * len(names) + 1.5))
    left = [0] * len(names)
    colors = {"2xx": "#2a7", "4xx": "#e9a23b", "5xx": "#c33"}
    for k in classes:
        ax.barh(names, counts[k], left=left, label=k, color=colors[k])
        left = [a + b for a, b in zip(left, counts[k], strict=True)]
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.legend()
    ax.set_title(
        f"schemathesis, {result.get('examples_per_operation', '?')} examples per operation: answers by status"
    )
    save(fig, path)


def plot_llm_gpu(result: dict[str, Any], path: Path) -> None:
    """Decode tokens/s and memory-bandwidth use per batch size on the GPU, eager and from captured
    graphs (medians of rounds; files from before the graphs existed hold one eager row per batch)."""
    summary = result.get("summary") or [{"batch": r["batch"], "eager": r} for r in result["decode"]]
    batches = [str(e["batch"]) for e in summary]
    modes = [m for m in ("eager", "graphs") if any(m in e for e in summary)]

    def series(key: str) -> dict[str, list[float]]:
        return {m: [e[m][key] if m in e else 0.0 for e in summary] for m in modes}

    fig, (left, right) = figure(1, 2, (11, 4.2))
    grouped_bars(left, batches, series("decode_tokens_per_s"))
    left.set_xlabel("batch")
    left.set_ylabel("decode tokens/s")
    grouped_bars(right, batches, series("bandwidth_utilisation"), fmt="{:.2f}")
    right.set_xlabel("batch")
    right.set_ylabel("share of measured copy bandwidth")
    fig.suptitle(f"{result['setup']['model']} on {result['setup']['gpu']}")
    save(fig, path)


#: result file stem -> how to draw it from its JSON (the scripts' own `plot`, called lazily, or ours)
OURS: dict[str, Plot] = {
    "gateway": plot_gateway,
    "limits": plot_limits,
    "router_recovery": plot_router_recovery,
    "runtimes": plot_runtimes,
    "http_stack": plot_http_stack,
    "workers": plot_workers,
    "workers_threads": plot_workers_threads,
    "tracing": plot_tracing,
    "fuzz": plot_fuzz,
    "llm_gpu": plot_llm_gpu,
    "llm_gpu_splits": plot_llm_gpu,
}
#: stem prefix -> (script module, how its `plot` takes the JSON)
SCRIPTS: dict[str, tuple[str, Callable[[dict[str, Any]], tuple[Any, ...]]]] = {
    "batching_modes": ("bench_batching_modes", lambda d: (d["median"],)),
    "grpc_floor": ("bench_grpc_floor", lambda d: (d["summary_median_of_rounds"],)),  # before "grpc"
    "grpc": ("bench_grpc", lambda d: (d["summary_median_of_rounds"],)),
    "policy_proxy": ("bench_policy_proxy", lambda d: (d["points"],)),
    "soak": ("soak", lambda d: (d["rss_mib"],)),
    "inline_runs": ("bench_inline_runs", lambda d: (d,)),
    "jwt": ("bench_jwt", lambda d: (d,)),
    "llm_engine": ("bench_llm_engine", lambda d: (d,)),
    "llm_int8": ("bench_llm_int8", lambda d: (d,)),
    "llm_vllm": ("bench_llm_vllm", lambda d: (d,)),
    "lora": ("bench_lora", lambda d: (d,)),
    "openvino_int8": ("bench_openvino_int8", lambda d: (d,)),
    "runtimes_gateway": ("bench_runtimes_gateway", lambda d: (d,)),
    "tensor_peers": ("bench_tensor_peers", lambda d: (d,)),
}


def _script_plot(stem: str) -> tuple[Callable[..., None], Callable[[dict[str, Any]], tuple[Any, ...]]] | None:
    for prefix, (module, args) in SCRIPTS.items():
        if stem == prefix or stem.startswith(prefix + "_"):
            return importlib.import_module(f"bench.{module}").plot, args
    return None


def stamp_existing(path: Path) -> bool:
    """Add the footer to a PNG drawn from data its JSON does not keep; False when it has one already."""
    if is_stamped(path):
        return False
    import matplotlib.image as mpimg
    import matplotlib.pyplot as plt

    image = mpimg.imread(path)
    height, width = image.shape[:2]
    fig = plt.figure(figsize=(width / 110, height / 110))
    ax = fig.add_axes((0, 0, 1, 1))  # the picture pixel for pixel: no resampling
    ax.imshow(image, interpolation="nearest")
    ax.set_axis_off()
    save(fig, path)
    return True


def redraw(path: Path) -> str:
    """Redraw `path` (a result JSON) as the PNG beside it; says how."""
    data = json.loads(path.read_text())
    png = path.with_suffix(".png")
    if path.stem in OURS:
        OURS[path.stem](data, png)
        return "drawn"
    found = _script_plot(path.stem)
    if found is not None:
        plot, args = found
        plot(*args(data), png)
        return "drawn by its script"
    if png.exists():
        return "footer added" if stamp_existing(png) else "already has its footer"
    return "no plot for this result"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "results", nargs="*", type=Path, help="result JSON files (default: all in bench/results)"
    )
    args = parser.parse_args()
    for path in args.results or sorted(RESULTS.glob("*.json")):
        try:
            how = redraw(path)
        except (KeyError, TypeError, ValueError, IndexError, ImportError) as exc:  # an older result's shape
            how = f"skipped: {type(exc).__name__}: {exc}"
        sys.stdout.write(f"{path.name}: {how}\n")


if __name__ == "__main__":
    main()
