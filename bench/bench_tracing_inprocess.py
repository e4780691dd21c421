"""The CPU tracing costs a request, measured inside one gateway process without the network.

`bench/bench_tracing.py` measures tracing through the front door, but on a machine whose speed
drifts by tens of percent within seconds its rounds cannot resolve a 5 % effect. This bench removes
what tracing does not touch: the gateway app (the one `fleetgate serve` runs, started with its
lifespan) is called directly as an ASGI app, one request at a time, so no client, socket or HTTP
parser shares the CPU or the measurement. Tracing is configured as in production (OTLP/HTTP to a
collector stand-in in its own process, the bench_tracing one) and switched between states the way a
config reload switches it:

- `off`: tracing off (`tracing.disable()`), measured twice per round (`off_again`, the noise floor);
- `on`: every request traced, with the spans fleetgate makes where the C module builds (C spans
  queued encoded, `gateway/telemetry.py`);
- `on_python`: every request traced with the Python `Span` and encoder (no C compiler, or
  `FLEETGATE_OTLP_NATIVE=0`).

Rounds visit the states in a balanced Latin square's orders (as bench_tracing); each visit serves
`--requests` requests of the digits model (v2 JSON, ONNX Runtime, unbatched, as bench_tracing) and
reads the process's CPU time (every thread: the span exporter's too) and the event loop thread's.
Rounds are short (20 requests a visit by default) and many, so the machine's drift, which is slow
next to a round, cancels in each round's difference between a state and `off`; the estimate is the
median of those paired differences over rounds, with a bootstrap 95 % interval, and as a ratio to
`off`'s median CPU a request. The exporter sends a batch every few hundred requests, so its sends
fall into every state's rounds: the exporter thread's CPU is spread over the states, not charged to
the traced ones (a few microseconds a request; `exporter_thread_us_per_request` gives it from the
traced states' process-minus-loop CPU over `off`'s). Requests/s of a CPU-bound server is the inverse
of its CPU a request, and this CPU leaves out the HTTP server's own share (which tracing does not
change), so the ratio here overstates tracing's share of a served request: a conservative reading
of the <= 5 % target.

Writes bench/results/tracing_inprocess.json and .png. Run:
`.venv/bin/python bench/bench_tracing_inprocess.py [--rounds 400 --requests 20]` (rounds: a multiple of 4).
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
os.environ.setdefault("FLEETGATE_GRPC_PORT", "off")
os.environ["FLEETGATE_ADMIN_KEY"] = "bench-admin-" + "k" * 32

import bench_tracing  # noqa: E402
from inprocess import call, paired, run_rounds, start_app  # noqa: E402

RESULTS = ROOT / "bench" / "results"
STATES = ["off", "on", "on_python", "off_again"]


async def measure(args: argparse.Namespace, tmp: Path, collector_port: int) -> dict:
    from backends.demo_models.digits import digits_split, write_all
    from fleetgate import otlp_native, tracing
    from gateway.app import create_app
    from gateway.config import parse_config
    from gateway.logs import configure_logging

    configure_logging("warning")
    models = write_all(tmp / "models", savedmodel=False, llama=False)
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{bench: {{}}}}
deployments: {{ort: {{backend: onnxruntime, model: {models["digits.onnx"]}}}}}
models: {{digits: {{routes: [{{deployment: ort}}]}}}}
tracing: {{enabled: true, otlp_endpoint: "http://127.0.0.1:{collector_port}/v1/traces"}}
""",
        base_dir=tmp,
    )
    app = create_app(config)
    shutdown = await start_app(app)
    admin = [
        (b"authorization", f"Bearer {os.environ['FLEETGATE_ADMIN_KEY']}".encode()),
        (b"content-type", b"application/json"),
    ]
    status, answer = await call(app, "/admin/keys", b'{"tenant": "bench"}', admin)
    if status != 201 and status != 200:
        raise RuntimeError(f"no key: {status} {answer[:200]!r}")
    headers = [
        (b"authorization", f"Bearer {json.loads(answer)['key']}".encode()),
        (b"content-type", b"application/json"),
    ]
    row = digits_split()[1][0].astype("float32").tolist()
    body = json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": row}]}
    ).encode()
    path = "/v2/models/digits/infer"

    export = app.state.tracing.export  # the configured batch exporter
    native = otlp_native.load()

    def switch(state: str) -> None:
        if state.startswith("off"):
            tracing.disable()
        elif state == "on":
            tracing.enable(export.add, 1.0, native=native, queue=export.native_queue() if native else None)
        else:
            tracing.enable(export.add, 1.0)

    async def request() -> None:
        await call(app, path, body, headers)

    for _ in range(300):  # warm: caches, the runtime, the key's record
        status, answer = await call(app, path, body, headers)
        if status != 200:
            raise RuntimeError(f"the model did not answer: {status} {answer[:200]!r}")
    rounds = await run_rounds(STATES, switch, request, args.rounds, args.requests)
    switch("on")
    await shutdown()
    return {"rounds": rounds, "c_spans": native is not None}


def summarize(rounds: list[dict]) -> dict:
    """Per state: medians over rounds, and against `off` the median of the rounds' paired
    differences (CPU a request, process and loop thread), its interval and its ratio."""
    out: dict = {}
    for state in STATES:
        out[state] = {
            key: statistics.median(r[state][key] for r in rounds)
            for key in ("cpu_us_per_request", "loop_thread_us_per_request")
        }
        if state == "off":
            continue
        cpu = paired(rounds, state, "off")
        loop = paired(rounds, state, "off", "loop_thread_us_per_request")
        out[state].update(
            added_us_per_request=cpu["difference_us"],
            added_us_per_request_95=cpu["difference_us_95"],
            added_loop_thread_us_per_request=loop["difference_us"],
            exporter_thread_us_per_request=cpu["difference_us"] - loop["difference_us"],
            cpu_over_off=cpu["ratio"],
            cpu_over_off_95=cpu["ratio_95"],
            # throughput of a CPU-bound server follows CPU a request
            throughput_over_off=1 / cpu["ratio"],
            meets_target_0_95=1 / cpu["ratio"] >= 0.95,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--requests", type=int, default=20, help="requests a state serves per round")
    args = parser.parse_args()
    collector = subprocess.Popen(
        [sys.executable, bench_tracing.__file__, "--collector"], stdout=subprocess.PIPE, text=True
    )
    try:
        collector_port = int(collector.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            measured = asyncio.run(measure(args, Path(tmp), collector_port))
        import httpx

        exported = httpx.get(f"http://127.0.0.1:{collector_port}/", timeout=120).json()
    finally:
        collector.kill()
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": vars(args),
        "c_spans": measured["c_spans"],
        "collector": exported,
        "median": summarize(measured["rounds"]),
        "rounds": measured["rounds"],
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "tracing_inprocess.json").write_text(json.dumps(out, indent=2))
    from plotting import figure, save

    fig, ax = figure(size=(7, 4))
    median = out["median"]
    shown = STATES[1:]
    added = [median[s]["added_us_per_request"] for s in shown]
    low = [a - median[s]["added_us_per_request_95"][0] for a, s in zip(added, shown, strict=True)]
    high = [median[s]["added_us_per_request_95"][1] - a for a, s in zip(added, shown, strict=True)]
    ax.bar(shown, added, yerr=[low, high], capsize=4, color=["#2a7", "#e9a23b", "#aaa"])
    ax.axhline(
        0.05 * median["off"]["cpu_us_per_request"], color="#c33", linestyle="--", label="5 % of off's CPU"
    )
    ax.set_ylabel("CPU a request over off (us; median of paired rounds, 95 %)")
    ax.set_title(
        f"Tracing's CPU a request, in process (digits, off: {median['off']['cpu_us_per_request']:.0f} us)"
    )
    ax.legend()
    save(fig, RESULTS / "tracing_inprocess.png")
    print(json.dumps(out["median"], indent=1))


if __name__ == "__main__":
    main()
