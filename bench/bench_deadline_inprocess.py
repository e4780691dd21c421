"""What a request's deadline scopes cost, in process: the gateway's `Deadline.scope()` against the
`asyncio.timeout_at` inside an `asynccontextmanager` it replaced.

Every request runs its waits under `server.request_timeout_s` (`gateway/deadline.py`): four to six
scopes a request, and a stream one per event. The gateway app is called in process on uvloop (as
`fleetgate serve` runs it; `bench/inprocess.py`), and `Deadline.scope` is switched between:

- `timeout_at`: the former implementation, kept here as the reference (`_timeout_at_scope`);
- `scope`: the one the gateway runs now (a small class with timeout_at's rules);
- `timeout_at_again`, `scope_again`: each measured twice a round, the noise floor.

Two request paths, each its own series of rounds:
- `chat`: OpenAI chat completions proxied to a minimal upstream in its own process (the one
  `bench_policy_proxy.py` runs), tenant with request, token and concurrency limits, quotas and
  per-key limits, state in SQLite: the policy proxy path of issue #14;
- `tensors`: the digits model on ONNX Runtime, v2 JSON, a tenant without limits.

Reported per path: CPU a request (every thread) per state, and `scope` against `timeout_at` as the
median of the rounds' paired differences with a bootstrap 95 % interval (the A/A pair alike).

    .venv/bin/python bench/bench_deadline_inprocess.py [--rounds 200 --requests 20]

Writes bench/results/deadline_inprocess.json and .png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
os.environ.setdefault("FLEETGATE_GRPC_PORT", "off")
os.environ["FLEETGATE_ADMIN_KEY"] = "bench-admin-" + "k" * 32

import bench_policy_proxy  # noqa: E402
from inprocess import call, paired, run_rounds, start_app  # noqa: E402

RESULTS = ROOT / "bench" / "results"
STATES = ["timeout_at", "scope", "timeout_at_again", "scope_again"]
HUGE = 10**15


@asynccontextmanager
async def _timeout_at_scope(self: Any) -> AsyncIterator[None]:
    """The reference: how `Deadline.scope` was written before (asyncio.timeout_at, a 504 on expiry)."""
    from gateway.deadline import timeout_error

    try:
        async with asyncio.timeout_at(self._at):
            yield
    except TimeoutError:
        raise timeout_error(self.timeout_s) from None


def config_text(upstream: int, models: dict[str, Path], state: str) -> str:
    return f"""
state: {{url: "{state}"}}
tenants:
  bench:
    limits: {{requests_per_minute: 10000000, tokens_per_minute: 1000000000, max_concurrency: 100000}}
    quotas: {{tokens_per_day: {HUGE}, tokens_per_month: {HUGE}, requests_per_day: {HUGE}, requests_per_month: {HUGE}}}
    key_limits: {{requests_per_minute: 10000000, tokens_per_minute: 1000000000}}
  free: {{}}
deployments:
  upstream: {{backend: remote, protocol: openai, url: "http://127.0.0.1:{upstream}", model_name: {bench_policy_proxy.MODEL}}}
  ort: {{backend: onnxruntime, model: {models["digits.onnx"]}}}
models:
  {bench_policy_proxy.MODEL}: {{routes: [{{deployment: upstream}}]}}
  digits: {{routes: [{{deployment: ort}}]}}
"""


async def new_key(app: Any, tenant: str) -> list[tuple[bytes, bytes]]:
    admin = [
        (b"authorization", f"Bearer {os.environ['FLEETGATE_ADMIN_KEY']}".encode()),
        (b"content-type", b"application/json"),
    ]
    status, answer = await call(app, "/admin/keys", json.dumps({"tenant": tenant}).encode(), admin)
    if status not in (200, 201):
        raise RuntimeError(f"no key: {status} {answer[:200]!r}")
    return [
        (b"authorization", f"Bearer {json.loads(answer)['key']}".encode()),
        (b"content-type", b"application/json"),
    ]


async def measure(args: argparse.Namespace, tmp: Path, upstream: int) -> dict:
    from backends.demo_models.digits import digits_split, write_all
    from gateway import deadline
    from gateway.app import create_app
    from gateway.config import parse_config
    from gateway.logs import configure_logging

    configure_logging("warning")
    models = write_all(tmp / "models", savedmodel=False, llama=False)
    config = parse_config(config_text(upstream, models, f"sqlite:///{tmp}/state.db"), base_dir=tmp)
    app = create_app(config)
    shutdown = await start_app(app)
    row = digits_split()[1][0].astype("float32").tolist()
    paths = {
        "chat": ("/v1/chat/completions", bench_policy_proxy.BODY.encode(), await new_key(app, "bench")),
        "tensors": (
            "/v2/models/digits/infer",
            json.dumps(
                {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": row}]}
            ).encode(),
            await new_key(app, "free"),
        ),
    }
    current = deadline.Deadline.scope

    def switch(state: str) -> None:
        deadline.Deadline.scope = _timeout_at_scope if state.startswith("timeout_at") else current

    measured = {}
    try:
        for name, (path, body, headers) in paths.items():
            for _ in range(300):  # warm: caches, the runtime, the key's record, the store
                status, answer = await call(app, path, body, headers)
                if status != 200:
                    raise RuntimeError(f"{name} did not answer: {status} {answer[:200]!r}")

            async def request(path: str = path, body: bytes = body, headers: list = headers) -> None:
                await call(app, path, body, headers)

            print(name, flush=True)
            measured[name] = await run_rounds(STATES, switch, request, args.rounds, args.requests)
    finally:
        deadline.Deadline.scope = current
        await shutdown()
    return measured


def summarize(rounds: list[dict]) -> dict:
    import statistics

    return {
        "cpu_us_per_request": {
            s: statistics.median(r[s]["cpu_us_per_request"] for r in rounds) for s in STATES
        },
        "scope_vs_timeout_at": paired(rounds, "scope", "timeout_at"),
        "scope_again_vs_timeout_at_again": paired(rounds, "scope_again", "timeout_at_again"),
        "a_a_timeout_at_again_vs_timeout_at": paired(rounds, "timeout_at_again", "timeout_at"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--requests", type=int, default=20, help="requests a state serves per round")
    args = parser.parse_args()
    upstream_port = bench_policy_proxy.free_port()
    upstream = subprocess.Popen(
        [sys.executable, bench_policy_proxy.__file__, "--upstream", str(upstream_port)]
    )
    try:
        bench_policy_proxy.wait_until(
            lambda: bench_policy_proxy.port_open(upstream_port), upstream, "upstream", 10
        )
        import uvloop

        with tempfile.TemporaryDirectory() as tmp:
            measured = uvloop.run(measure(args, Path(tmp), upstream_port))
    finally:
        bench_policy_proxy.stop(upstream)
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": vars(args),
        "median": {name: summarize(rounds) for name, rounds in measured.items()},
        "rounds": measured,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "deadline_inprocess.json").write_text(json.dumps(out, indent=2))
    from plotting import figure, save

    fig, ax = figure(size=(7, 4))
    names = list(out["median"])
    for offset, (key, label, color) in enumerate(
        [
            ("scope_vs_timeout_at", "scope - timeout_at", "#2a7"),
            ("a_a_timeout_at_again_vs_timeout_at", "A/A", "#aaa"),
        ]
    ):
        found = [out["median"][n][key] for n in names]
        diff = [f["difference_us"] for f in found]
        errors = [
            [d - f["difference_us_95"][0] for d, f in zip(diff, found, strict=True)],
            [f["difference_us_95"][1] - d for d, f in zip(diff, found, strict=True)],
        ]
        ax.bar(
            [i + 0.4 * offset for i in range(len(names))],
            diff,
            0.4,
            yerr=errors,
            capsize=4,
            color=color,
            label=label,
        )
    ax.set_xticks([i + 0.2 for i in range(len(names))], names)
    ax.axhline(0, color="#333", linewidth=0.8)
    ax.set_ylabel("CPU a request, difference (us; median of paired rounds, 95 %)")
    ax.set_title("Deadline scopes: the gateway's class vs asyncio.timeout_at, in process")
    ax.legend()
    save(fig, RESULTS / "deadline_inprocess.png")
    print(json.dumps(out["median"], indent=1))


if __name__ == "__main__":
    main()
