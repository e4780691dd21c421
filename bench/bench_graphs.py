"""A model graph served by the gateway vs the same steps called one by one by a client over HTTP.

One `fleetgate serve` subprocess serves four small ONNX models (tests/graph_models.py): `scale`
(pre-processing) and `average` on ONNX Runtime, `mlp-a` on ONNX Runtime, `mlp-b` on OpenVINO, and
the three-step graph `ensemble` over them (scale -> mlp-a and mlp-b in parallel -> average). Three
clients get the same answer, at concurrency 1 and 16, closed loop (each caller sends its next
request when its answer is in), over keep-alive HTTP/1.1 with v2 binary tensors:
  - graph:          one `/v2/models/ensemble/infer` per answer;
  - one_by_one:     four requests in a row (scale, mlp-a, mlp-b, average), each step's output sent
                    back as the next step's input;
  - client_parallel: as one_by_one, but mlp-a and mlp-b sent at once on two connections (the best a
                    client can do without the gateway's help).
Interleaved rounds (the order of the clients rotates each round); medians over rounds of p50/p99
latency and answers/s. Target (issue 21): the graph is faster than the steps one by one.

Writes bench/results/graphs.json and graphs.png. Run: `.venv/bin/python -m bench.bench_graphs [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from bench.bench_gateway import pct, start_gateway, v2_request
from tests.graph_models import ensemble_by_hand, ensemble_steps, step_sections, write_graph_models

ROOT = Path(__file__).resolve().parents[1]

RESULTS = ROOT / "bench" / "results"
CONCURRENCY = (1, 16)
CLIENTS = ("graph", "one_by_one", "client_parallel")
ROWS = 4


class Connection:
    """A keep-alive connection that sends v2 binary requests and decodes binary answers."""

    def __init__(self, port: int, key: str) -> None:
        self.port, self.key = port, key
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> Connection:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    async def infer(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.reader is not None and self.writer is not None
        self.writer.write(v2_request(model, inputs, self.key, self.port))
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
        fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
        body = await self.reader.readexactly(int(fields[b"content-length"]))
        if status != 200:
            raise RuntimeError(f"{model}: {status} {body[:200]!r}")
        json_len = int(fields[b"inference-header-content-length"])
        offset, outputs = json_len, {}
        for out in json.loads(body[:json_len])["outputs"]:
            size = out["parameters"]["binary_data_size"]
            outputs[out["name"]] = np.frombuffer(body[offset : offset + size], np.float32).reshape(
                out["shape"]
            )
            offset += size
        return outputs


async def graph_answer(conns: list[Connection], x: np.ndarray) -> np.ndarray:
    return (await conns[0].infer("ensemble", {"pixels": x}))["probabilities"]


async def one_by_one_answer(conns: list[Connection], x: np.ndarray) -> np.ndarray:
    c = conns[0]
    scaled = (await c.infer("scale", {"raw": x}))["scaled"]
    a = (await c.infer("mlp-a", {"x": scaled}))["probs"]
    b = (await c.infer("mlp-b", {"x": scaled}))["probs"]
    return (await c.infer("average", {"a": a, "b": b}))["mean"]


async def client_parallel_answer(conns: list[Connection], x: np.ndarray) -> np.ndarray:
    scaled = (await conns[0].infer("scale", {"raw": x}))["scaled"]
    a, b = await asyncio.gather(
        conns[0].infer("mlp-a", {"x": scaled}), conns[1].infer("mlp-b", {"x": scaled})
    )
    return (await conns[0].infer("average", {"a": a["probs"], "b": b["probs"]}))["mean"]


ANSWER = {"graph": graph_answer, "one_by_one": one_by_one_answer, "client_parallel": client_parallel_answer}


async def _load(client: str, port: int, key: str, x: np.ndarray, concurrency: int, seconds: float) -> dict:
    latencies: list[float] = []
    answer = ANSWER[client]

    async def caller() -> None:
        conns = [await Connection(port, key).open() for _ in range(2)]
        try:
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                await answer(conns, x)
                latencies.append(time.perf_counter() - t0)
        finally:
            for c in conns:
                c.close()

    start = time.perf_counter()
    stop = start + seconds
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    return {
        "answers": len(latencies),
        "answers_per_s": len(latencies) / elapsed,
        "p50_ms": pct(latencies, 50) * 1000,
        "p99_ms": pct(latencies, 99) * 1000,
    }


async def _check(port: int, key: str, x: np.ndarray, expected: np.ndarray) -> None:
    """Every client gets the answer the steps computed by hand give (else the comparison is moot)."""
    conns = [await Connection(port, key).open() for _ in range(2)]
    try:
        for client, answer in ANSWER.items():
            got = await answer(conns, x)
            if not np.allclose(got, expected, atol=1e-5):
                raise AssertionError(f"{client}: answer differs from the steps by hand")
    finally:
        for c in conns:
            c.close()


def plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xs = np.arange(len(CONCURRENCY))
    for i, client in enumerate(CLIENTS):
        for ax, metric in zip(axes, ("p50_ms", "answers_per_s"), strict=True):
            values = [summary[f"c{c}"][client][metric] for c in CONCURRENCY]
            ax.bar(xs + (i - 1) * 0.27, values, 0.27, label=client)
    for ax, label in zip(axes, ("p50 latency per answer (ms)", "answers / s"), strict=True):
        ax.set_xticks(xs, [f"c={c}" for c in CONCURRENCY])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(
        f"3-step ensemble ({ROWS} rows): graph in the gateway vs steps called by the client (medians)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="graphs")
    args = parser.parse_args()
    x = np.random.default_rng(0).uniform(0, 16, (ROWS, 64)).astype(np.float32)
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        models = write_graph_models(Path(tmp))
        deployments, served = step_sections(models)
        deployments["b-ov"]["options"] = {"num_threads": 1}  # OpenVINO's spinning threads cost 2 cores here

        def config(port: int) -> str:
            return yaml.safe_dump(
                {
                    "server": {"port": port, "log_level": "warning"},
                    "state": {"url": "memory://"},
                    "tenants": {"bench": {}},
                    "deployments": deployments,
                    "models": served,
                    "graphs": {
                        "ensemble": {"steps": ensemble_steps(), "outputs": {"probabilities": "mean.mean"}}
                    },
                },
                sort_keys=False,
            )

        proc, port, key = start_gateway(Path(tmp), config)
        try:
            asyncio.run(_check(port, key, x, ensemble_by_hand(models, x)))
            for r in range(args.rounds):
                result: dict = {}
                for c in CONCURRENCY:
                    order = CLIENTS[r % 3 :] + CLIENTS[: r % 3]  # interleaved: who goes first rotates
                    asyncio.run(_load(order[0], port, key, x, c, 0.5))  # warm-up
                    result[f"c{c}"] = {
                        client: asyncio.run(_load(client, port, key, x, c, args.seconds)) for client in order
                    }
                    print(
                        f"round {r + 1} c={c}: "
                        + ", ".join(f"{k} p50 {v['p50_ms']:.2f} ms" for k, v in result[f"c{c}"].items()),
                        flush=True,
                    )
                rounds.append(result)
        except Exception:
            for log in Path(tmp).glob("gateway-*.log"):  # what the gateway said about it
                print(log.read_text()[-4000:], file=sys.stderr)
            raise
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    summary: dict = {}
    for c in CONCURRENCY:
        cell = summary[f"c{c}"] = {}
        for client in CLIENTS:
            cell[client] = {
                m: float(statistics.median(r[f"c{c}"][client][m] for r in rounds))
                for m in ("p50_ms", "p99_ms", "answers_per_s")
            }
        cell["graph_speedup_p50_vs_one_by_one"] = cell["one_by_one"]["p50_ms"] / cell["graph"]["p50_ms"]
        cell["graph_speedup_p50_vs_client_parallel"] = (
            cell["client_parallel"]["p50_ms"] / cell["graph"]["p50_ms"]
        )
        cell["graph_throughput_vs_one_by_one"] = (
            cell["graph"]["answers_per_s"] / cell["one_by_one"]["answers_per_s"]
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {
        "what": "3-step ensemble graph served by fleetgate vs the same steps called by an HTTP client",
        "rows_per_request": ROWS,
        "seconds_per_cell": args.seconds,
        "rounds": args.rounds,
        "machine": {"cpus": __import__("os").cpu_count(), "python": platform.python_version()},
        "summary_medians": summary,
        "rounds_raw": rounds,
    }
    (RESULTS / f"{args.out}.json").write_text(json.dumps(out, indent=2))
    plot(summary, RESULTS / f"{args.out}.png")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
