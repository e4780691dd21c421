"""A refactor's before and after on one machine in one session: two checkouts measured interleaved.

Each of `--before` and `--after` is a checkout (e.g. `git worktree add /tmp/before <commit>`). Every
round runs, for each checkout in turn, `bench_policy_proxy` (OpenAI chat through the tenant policy
path, wrk at c=1 and c=16) and `bench_tensor_peers` (one-row v2 tensors to an ONNX MLP, c=1 and c=32),
each with `--rounds 1`: before, after, after, before, ... (the order flips every round, so neither
checkout always runs first or last). Each script is its own checkout's, run the way that checkout
runs it (`python -m bench.<name>` where `bench/` is a package, `python bench/<name>.py` before), with
the checkout as working directory and `PYTHONPATH`, so that it and the gateways it starts import that
checkout's code and not the virtualenv's editable install (checked first: a child prints where
`gateway`, `backends`, `router` and `policies` come from). Peers (LiteLLM, KServe, BentoML) and the
bare-stack floors run beside fleetgate in every run as the scripts start them: they are the within-run
controls that show how much the machine itself moved between a before and an after.

Reported per fleetgate figure: the median of each checkout's rounds, their spread (min-max), the ratio
after/before of the medians and the median of the per-round ratios (round i's after over round i's
before, measured minutes apart), and how much worse the after is in percent (positive: worse; for
req/s lower is worse, for latencies and CPU higher is worse).

`--starts N` also measures the start of a gateway serving an LLM on empty caches, N times per
checkout: fresh `HOME`, `XDG_CACHE_HOME` and `TORCH_EXTENSIONS_DIR`, `fleetgate serve` with one
`torch_llm` deployment (the demo's random-weight tiny Llama, written once here), time from spawn
until `/health/ready` answers 200, and the CPU the process and its children used until then.

Run: `.venv/bin/python -m bench.bench_house_compare --before /tmp/before --after /tmp/after
[--rounds 3 --policy-seconds 3 --tensor-seconds 3 --starts 1]`.
Writes bench/results/house_before_after.json and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.servers import ROOT, free_port

RESULTS = ROOT / "bench" / "results"
#: (bench, server, concurrency, metric, True when higher is better): the fleetgate figures compared
POLICY_SERVERS = ("fleetgate_sqlite", "fleetgate_sqlite_thread", "fleetgate_redis", "fleetgate_no_policy")
FIGURES: list[tuple[str, str, str, str, bool]] = [
    *[("policy_proxy", s, c, m, m == "rps") for s in POLICY_SERVERS for c in ("c1", "c16")
      for m in ("rps", "p50_ms", "p99_ms", "added_p50_ms", "cpu_ms_per_req")],
    *[("tensor_peers", "fleetgate", c, m, m == "rps") for c in ("c1", "c32") for m in ("rps", "p50_ms", "p99_ms")],
]  # fmt: skip
#: the same points for what runs beside fleetgate: they show how far the machine moved between runs
CONTROLS: list[tuple[str, str, str, str, bool]] = [
    *[("policy_proxy", s, c, "rps", True) for s in ("upstream", "bare_proxy", "litellm") for c in ("c1", "c16")],
    *[("tensor_peers", s, c, "rps", True) for s in ("floor_batching", "floor_inline", "kserve", "bentoml")
      for c in ("c1", "c32")],
]  # fmt: skip


NOTES = [
    "bare_proxy (bench/floor_servers.py proxy) is not shared code: at bc1f8af it forwards with the own "
    "HTTP/1.1 client (backends.upstream_http.UpstreamPool), after the refactor with httpx.AsyncClient, as "
    "the remote backend does: its after/before is the upstream client's own cost, not the machine's drift",
    "cpu_ms_per_req is the gateway process's own CPU (user + system) per request: the figure least moved "
    "by other processes on a shared machine; req/s and latencies move with the load of the machine",
]
#: "a/b": a's figure over b's in the same run, b being code both checkouts share (the tensor floors, the
#: upstream): what is left of the machine's drift between a before and an after once it is divided out
NORMALIZED: list[tuple[str, str, str, str, bool]] = [
    *[("policy_proxy", f"{s}/upstream", c, "rps", True) for s in POLICY_SERVERS for c in ("c1", "c16")],
    *[("tensor_peers", "fleetgate/floor_batching", c, "rps", True) for c in ("c1", "c32")],
    ("tensor_peers", "fleetgate/floor_batching", "c1", "p50_ms", False),
]


@dataclass(frozen=True)
class Tree:
    """One checkout to measure."""

    label: str
    path: Path

    @property
    def packaged(self) -> bool:
        """Whether its `bench/` is a package (run as `-m bench.x`) or a folder of scripts."""
        return (self.path / "bench" / "__init__.py").exists()

    def commit(self) -> str:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=self.path, capture_output=True, text=True, check=True
        ).stdout.strip()

    def env(self, **extra: str) -> dict[str, str]:
        # PYTHONPATH comes before the editable install's path: the checkout's code is imported
        return {**os.environ, "PYTHONPATH": str(self.path), **extra}

    def script(self, name: str, *args: str) -> list[str]:
        if self.packaged:
            return [sys.executable, "-m", f"bench.{name}", *args]
        return [sys.executable, f"bench/{name}.py", *args]

    def cli_module(self) -> str:
        """The module of its `fleetgate` command (moved into gateway/serve/ by the refactor)."""
        return "gateway.serve.cli" if (self.path / "gateway" / "serve" / "cli.py").exists() else "gateway.cli"


def check_imports(tree: Tree) -> dict[str, str]:
    """Where a child started like the benches' children imports the product packages from."""
    code = "import json, gateway, backends, router, policies; print(json.dumps({m.__name__: m.__file__ for m in (gateway, backends, router, policies)}))"  # noqa: E501
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree.path, env=tree.env(), capture_output=True, text=True, check=True
    )
    found: dict[str, str] = json.loads(out.stdout)
    strays = {name: path for name, path in found.items() if not Path(path).is_relative_to(tree.path)}
    if strays:
        raise SystemExit(f"{tree.label}: imports outside {tree.path}: {strays}")
    return found


# --- one run of each bench -------------------------------------------------------------------------


def run_policy(tree: Tree, seconds: float) -> dict[str, Any]:
    """bench_policy_proxy with one round; its result file is read and the checkout's copy put back."""
    result = tree.path / "bench" / "results" / "policy_proxy.json"
    kept = {p: p.read_bytes() for p in (result, result.with_suffix(".png")) if p.exists()}
    try:
        subprocess.run(
            tree.script("bench_policy_proxy", "--rounds", "1", "--seconds", f"{seconds:g}"),
            cwd=tree.path, env=tree.env(), check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        report = json.loads(result.read_text())
    finally:
        for path, data in kept.items():
            path.write_bytes(data)
    return {"points": report["per_round"][0], "notes": report.get("notes", [])}


def run_tensor(tree: Tree, seconds: float, work: Path) -> dict[str, Any]:
    """bench_tensor_peers with one round, its result written under `work`."""
    out = work / f"tensor-{tree.label}-{time.monotonic_ns()}.json"
    subprocess.run(
        tree.script("bench_tensor_peers", "--rounds", "1", "--seconds", f"{seconds:g}", "--out", str(out)),
        cwd=tree.path, env=tree.env(), check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    report = json.loads(out.read_text())
    return {"points": report["per_round"][0], "skipped": report.get("skipped", {})}


# --- the start of a gateway with an LLM on empty caches -----------------------------------------------

START_CONFIG = """\
server: {{port: {port}, grpc_port: null, log_level: info}}
state: {{url: "memory://"}}
tenants: {{bench: {{}}}}
deployments:
  tiny-llama: {{backend: torch_llm, model: {model}, device: cpu, options: {{block_size: 16}}}}
models:
  tiny-llama: {{routes: [{{deployment: tiny-llama}}]}}
"""


def measure_start(tree: Tree, model: Path, timeout_s: float) -> dict[str, Any]:
    """Spawn to `/health/ready` 200 with empty caches; the CPU used is read when it has stopped."""
    with tempfile.TemporaryDirectory(prefix=f"start-{tree.label}-") as tmp:
        work = Path(tmp)
        dirs = {name: work / name for name in ("home", "cache", "torch_extensions")}
        for d in dirs.values():
            d.mkdir()
        port = free_port()
        config = work / "gateway.yaml"
        config.write_text(START_CONFIG.format(port=port, model=model))
        env = tree.env(
            HOME=str(dirs["home"]), XDG_CACHE_HOME=str(dirs["cache"]),
            TORCH_EXTENSIONS_DIR=str(dirs["torch_extensions"]), FLEETGATE_GRPC_PORT="off",
        )  # fmt: skip
        log = work / "serve.log"
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", tree.cli_module(), "serve", "--config", str(config)],
            cwd=tree.path, env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb"),
        )  # fmt: skip
        first_answer = ready = None
        while ready is None and proc.poll() is None and time.monotonic() - started < timeout_s:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2).status_code
                first_answer = first_answer or time.monotonic() - started
                if status == 200:
                    ready = time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        text = log.read_text(errors="replace")
        built = list(dirs["torch_extensions"].rglob("*.so")) + list(dirs["cache"].rglob("*.so"))
        return {
            "ready_s": round(ready, 2) if ready is not None else None,
            "first_http_answer_s": round(first_answer, 2) if first_answer is not None else None,
            "exit_code": proc.returncode,
            "libraries_built_into_empty_caches": len(built),
            "log_lines_naming_build_kernels": sum("build-kernels" in line for line in text.splitlines()),
            "log_tail": text[-600:] if ready is None else "",
        }


def children_cpu_s() -> float:
    """CPU (user + system) of every child this process has waited for so far."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --- report ------------------------------------------------------------------------------------------


def figure_key(bench: str, server: str, c: str, metric: str) -> str:
    return f"{bench}.{server}.{c}.{metric}"


def point_value(points: dict[str, Any], server: str, c: str, metric: str) -> float | None:
    """`server`'s figure in one run, or for "a/b" a's over b's; None where one was not run."""
    names = server.split("/")
    found = [points.get(name, {}).get(c, {}).get(metric) for name in names]
    if any(v is None for v in found) or (len(found) == 2 and not found[1]):
        return None
    return found[0] / found[1] if len(found) == 2 else found[0]


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "fleetgate": compare(rounds, FIGURES),
        "normalized": compare(rounds, NORMALIZED),
        "controls": compare(rounds, CONTROLS),
    }


def compare(rounds: list[dict[str, Any]], figures: list[tuple[str, str, str, str, bool]]) -> dict[str, Any]:
    """Per figure: medians, spread, ratio of medians, median of per-round ratios, % worse."""
    table: dict[str, Any] = {}
    for bench, server, c, metric, higher_better in figures:
        values: dict[str, list[float]] = {"before": [], "after": []}
        for r in rounds:
            for label in values:
                value = point_value(r[label].get(bench, {}).get("points", {}), server, c, metric)
                if value is not None:
                    values[label].append(value)
        if len(values["before"]) != len(rounds) or len(values["after"]) != len(rounds):
            continue  # not run (a peer skipped) in every round
        before, after = statistics.median(values["before"]), statistics.median(values["after"])
        paired = [a / b for a, b in zip(values["after"], values["before"], strict=True) if b]
        ratio = after / before if before else float("nan")
        table[figure_key(bench, server, c, metric)] = {
            "before": round(before, 4),
            "after": round(after, 4),
            "before_range": [round(min(values["before"]), 4), round(max(values["before"]), 4)],
            "after_range": [round(min(values["after"]), 4), round(max(values["after"]), 4)],
            "after_over_before": round(ratio, 3),
            "per_round_ratio_median": round(statistics.median(paired), 3) if paired else None,
            "per_round_ratios": [round(x, 3) for x in paired],
            # positive: the after is worse by this much; a latency's or CPU's ratio is inverted
            "worse_pct": round((1 / ratio - 1 if higher_better else ratio - 1) * 100, 1),
        }
    return table


def plot(report: dict[str, Any], path: Path) -> None:
    from bench import plotting

    # fleetgate's figures, then the same divided by shared code, then the shared code alone (grey:
    # how far the machine itself moved between a before and an after)
    rows = {k: v for k, v in report["fleetgate"].items() if not k.endswith("added_p50_ms")}
    rows |= report["normalized"]
    rows |= {f"{k} (control)": v for k, v in report["controls"].items()}
    fig, ax = plotting.figure(size=(10, 0.24 * len(rows) + 1.5))
    names = list(rows)
    ys = range(len(names))
    # shown as "after better (> 1) or worse (< 1)": req/s as after/before, latencies and CPU inverted
    good = [1 / (1 + rows[n]["worse_pct"] / 100) for n in names]
    colors = ["grey" if n.endswith("(control)") else "C2" if g >= 0.9 else "C3" for n, g in zip(names, good, strict=True)]
    ax.barh(ys, [g - 1 for g in good], left=1, color=colors)
    ax.axvline(1, color="black", linewidth=0.8)
    ax.axvline(0.9, color="C3", linestyle="--", linewidth=0.8, label="10 % worse")
    ax.set_yticks(list(ys), [n.replace("policy_proxy.", "policy ").replace("tensor_peers.", "tensor ") for n in names])
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("after vs before (> 1: better; req/s after/before, latency and CPU before/after), medians")
    ax.set_title(f"{report['commits']['before'][:7]} -> {report['commits']['after'][:7]}, "
                 f"{report['rounds']} interleaved rounds")  # fmt: skip
    ax.legend(fontsize=8)
    plotting.save(fig, path)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """The interleaved rounds and the starts; returns the report without its summaries."""
    trees = [Tree("before", args.before.resolve()), Tree("after", args.after.resolve())]
    imports = {t.label: check_imports(t) for t in trees}
    started, load_before = time.perf_counter(), os.getloadavg()
    rounds: list[dict[str, Any]] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="house-") as tmp:
        for index in range(args.rounds):
            result: dict[str, Any] = {"order": []}
            for tree in trees if index % 2 == 0 else trees[::-1]:
                result["order"].append(tree.label)
                result[tree.label] = {}
                if "policy_proxy" in args.benches:
                    result[tree.label]["policy_proxy"] = run_policy(tree, args.policy_seconds)
                if "tensor_peers" in args.benches:
                    result[tree.label]["tensor_peers"] = run_tensor(tree, args.tensor_seconds, Path(tmp))
                sys.stderr.write(f"round {index + 1} {tree.label} done at {time.perf_counter() - started:.0f} s\n")
            rounds.append(result)
            # kept as it goes (bench/results/*.tmp is ignored by git): a late failure keeps the rounds
            args.out.with_suffix(".tmp").write_text(json.dumps(rounds))
        starts: dict[str, list[dict[str, Any]]] = {t.label: [] for t in trees}
        if args.starts:
            from backends.demo_models.tiny_llama import write_tiny_llama

            model = Path(tmp) / "tiny-llama"
            write_tiny_llama(model)
            for index in range(args.starts):
                for tree in trees:
                    if tree.label == "before" and args.before_starts is not None and index >= args.before_starts:
                        continue
                    cpu0 = children_cpu_s()
                    point = measure_start(tree, model, args.start_timeout)
                    point["cpu_s_until_stopped"] = round(children_cpu_s() - cpu0, 1)
                    starts[tree.label].append(point)
                    sys.stderr.write(f"start {tree.label}: {point}\n")
    return {
        "benchmark": "bench_house_compare",
        "what": (__doc__ or "").split("\n\n")[0],
        "commits": {t.label: t.commit() for t in trees},
        "imports_checked": imports,
        "rounds": args.rounds,
        "benches": args.benches,
        "seconds_per_point": {"policy_proxy": args.policy_seconds, "tensor_peers": args.tensor_seconds},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_before_after": [load_before, os.getloadavg()]},  # fmt: skip
        "start_llm_empty_caches": starts,
        "per_round": rounds,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--before", type=Path, help="checkout of the commit before")
    parser.add_argument("--after", type=Path, help="checkout of the commit after")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--benches", nargs="+", choices=("policy_proxy", "tensor_peers"), default=["policy_proxy", "tensor_peers"]
    )
    parser.add_argument("--policy-seconds", type=float, default=3.0)
    parser.add_argument("--tensor-seconds", type=float, default=3.0)
    parser.add_argument("--starts", type=int, default=1, help="LLM starts on empty caches per checkout (0: none)")
    parser.add_argument(
        "--before-starts", type=int, help="at most this many for --before (its start may compile for minutes)"
    )
    parser.add_argument("--start-timeout", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "house_before_after.json")
    parser.add_argument(
        "--summarize-only", action="store_true", help="recompute the summaries and the plot of --out, measuring nothing"
    )
    args = parser.parse_args()
    if args.summarize_only:
        report = json.loads(args.out.read_text())
    elif args.before is None or args.after is None:
        parser.error("--before and --after are required unless --summarize-only")
    else:
        report = measure(args)
    # the summaries first in the file, then the starts and the raw rounds
    report = {k: v for k, v in report.items() if k not in ("notes", "fleetgate", "normalized", "controls")}
    raw = {k: report.pop(k) for k in ("start_llm_empty_caches", "per_round", "wall_s")}
    report |= {"notes": NOTES} | summarize(raw["per_round"]) | raw
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".tmp").unlink(missing_ok=True)
    plot(report, args.out.with_suffix(".png"))
    for key, row in (report["fleetgate"] | report["normalized"]).items():
        print(f"{key:55s} {row['before']:10.3f} {row['after']:10.3f} {row['after_over_before']:6.3f}x "
              f"worse {row['worse_pct']:+6.1f} %")  # fmt: skip
    print(json.dumps(report["start_llm_empty_caches"], indent=1))


if __name__ == "__main__":
    main()
