"""What the hot path's recent changes save, in process: each against the code it replaced.

The gateway app is called in process on uvloop (as `fleetgate serve` runs it; `bench/inprocess.py`),
and each change can be switched back to what it replaced, kept here as the reference:

- `deadline`: `Deadline.scope()` (a small class with asyncio.timeout_at's rules) against
  `asyncio.timeout_at` inside an `asynccontextmanager` (`_timeout_at_scope`). A request runs four
  to six scopes, a stream one per event.
- `response`: a whole chat answer sent as a bare ASGI app (`raw_json_response`) against a Litestar
  `Response` converted on every call (`json_response`, still what other routes return).
- `one_choice`: a single choice (`n` = 1, nearly every request) read in the request's own task
  (`collect_choices`) against a task of `asyncio.gather`'s for it (`_gather_choices`).
- `queue`: a request that finds its deployment's fair queue empty with a free slot passes straight
  through (`FairQueue._pass_through`) against queueing, dispatching and granting it through the
  backlog (`_never_pass_through`).
- `store`: SQLite's settle corrects its buckets in one UPSERT and counts leases in one SELECT,
  against a read and a write (`_read_then_write_buckets`) and a DELETE and a SELECT
  (`_delete_then_count_leases`, `_remove_one_lease`).
- `redis`: the Redis store's pipeline sender on a connection of its own (`RedisStore._round_trip`)
  against redis-py's `Pipeline` (`_redis_py_pipeline_send`).
- `metrics`: the request path's labelled metric children kept (`gateway.observe.metrics.child`) against
  `labels()` asked each time (`_labels_each_time`).
- `admit_at_once`: a tenant with no limits, key limits or quotas admitted at once
  (`Admission.admit_at_once`) against `admit` in a task of its own guarded by `shield`, as every
  request was (`_always_through_the_store`). Only the `tensors` path's tenant has nothing to check.
- `one_route`: a model with one route of positive weight gets the plan the router made once for its
  config (`Router._fixed`) against the caller's bucket hashed and the slices walked on every request
  (`_always_through_the_bucket`). Every path's model has one route.

States, visited in every round in a balanced order: `before` (every change switched back), `after`
(the code as it is), `only_<change>` (that change alone), and `after_again` (`after` measured twice
a round: the noise floor).

Three request paths, each its own series of rounds:
- `chat`: OpenAI chat completions proxied to a minimal upstream in its own process (the one
  `bench_policy_proxy.py` runs), tenant with request, token and concurrency limits, quotas and
  per-key limits, state in SQLite: the policy proxy path of issue #14;
- `chat_redis`: the same on a second app whose state is a redis-server started here (its own
  process: the server's CPU is not in the figures, the client's is);
- `tensors`: the digits model on ONNX Runtime, v2 JSON, a tenant without limits.

Reported per path: CPU a request (every thread) per state, and each state against `before` as the
median of the rounds' paired differences with a bootstrap 95 % interval.

    .venv/bin/python -m bench.bench_hot_path_inprocess [--rounds 200 --requests 20]

Writes bench/results/hot_path_inprocess.json and .png.
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
from contextlib import ExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("FLEETGATE_GRPC_PORT", "off")
os.environ["FLEETGATE_ADMIN_KEY"] = "bench-admin-" + "k" * 32

from bench import bench_policy_proxy  # noqa: E402
from bench.inprocess import call, paired, run_rounds, start_app  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CHANGES = [
    "deadline", "response", "one_choice", "queue", "store", "redis", "metrics", "admit_at_once", "one_route",
]  # fmt: skip
STATES = ["before", "after", *(f"only_{c}" for c in CHANGES), "after_again"]


@asynccontextmanager
async def _timeout_at_scope(self: Any) -> AsyncIterator[None]:
    """The reference: how `Deadline.scope` was written before (asyncio.timeout_at, a 504 on expiry)."""
    from gateway.core.deadline import timeout_error

    try:
        async with asyncio.timeout_at(self._at):
            yield
    except TimeoutError:
        raise timeout_error(self.timeout_s) from None


async def _gather_choices(streams: list) -> list:
    """The reference: every choice read in a task of `gather`'s, even a single one (as before)."""
    from gateway.http.openai_choices import collect_choice

    return list(await asyncio.gather(*(collect_choice(s) for s in streams)))


def _never_pass_through(self: Any) -> bool:
    """The reference: every request queued, dispatched and granted through the backlog (as before)."""
    return False


def _read_then_write_buckets(self: Any, ops: list, now: float) -> None:
    """The reference: a settle's bucket correction as a read, Python arithmetic and a write (as before)."""
    from policies.stores import _engine

    states = self.get_buckets([op.key for op in ops])
    self.set_buckets(
        [(op.key, *_engine.adjust(state, op, now)) for op, state in zip(ops, states, strict=True)]
    )


def _delete_then_count_leases(self: Any, key: str, now: float) -> int:
    """The reference: expired leases deleted, then the rest counted, two statements (as before)."""
    self.c.execute("DELETE FROM leases WHERE key = ? AND expires_at <= ?", (key, now))
    return self.c.execute("SELECT count(*) FROM leases WHERE key = ?", (key,)).fetchone()[0]


def _remove_one_lease(self: Any, key: str, lease_id: str, now: float) -> None:
    """The reference: a settle deletes its own lease only (as before)."""
    self.c.execute("DELETE FROM leases WHERE key = ? AND lease_id = ?", (key, lease_id))


async def _redis_py_pipeline_send(self: Any, group: list) -> list:
    """The reference: a group of scripts sent through redis-py's Pipeline (as before)."""
    pipe = self._client.pipeline(transaction=False)
    for script, keys, args, _ in group:
        pipe.evalsha(script.sha, len(keys), *keys, *args)
    try:
        results = await pipe.execute(raise_on_error=False)
    except Exception as exc:  # noqa: BLE001 - every caller of the group gets the failure
        results = [self._failure(exc)] * len(group)
    self.pipelines += 1
    self.pipelined_ops += len(group)
    return results


def _labels_each_time(metric: Any, *labels: str) -> Any:
    """The reference: prometheus_client's `labels()` asked on every request (as before)."""
    return metric.labels(*labels)


def _always_through_the_store(self: Any, principal: Any, model: str, cost_tokens: int) -> None:
    """The reference: every request admitted through `admit`, in a task of its own (as before)."""
    return None


def _always_through_the_bucket(
    self: Any,
    model: str,
    *,
    version: Any = None,
    label: Any = None,
    principal: Any = None,
    headers: Any = None,
) -> Any:
    """The reference: every request's plan made through its bucket (as before)."""
    return self._plan_by_bucket(model, self.get(model), version, label, principal, headers)


def config_text(upstream: int, models: dict[str, Path], state: str) -> str:
    return f"""
state: {{url: "{state}"}}
tenants:
{bench_policy_proxy.POLICY_TENANT_YAML}  free: {{}}
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


async def measure(args: argparse.Namespace, tmp: Path, upstream: int, redis_url: str) -> dict:
    from backends.demo_models.digits import digits_split, write_all
    from gateway.config import parse_config
    from gateway.core import deadline
    from gateway.http.app import create_app
    from gateway.observe.logs import configure_logging

    configure_logging("warning")
    models = write_all(tmp / "models", savedmodel=False, llama=False)
    config = parse_config(config_text(upstream, models, f"sqlite:///{tmp}/state.db"), base_dir=tmp)
    app = create_app(config)
    on_redis = create_app(parse_config(config_text(upstream, models, redis_url), base_dir=tmp))
    shutdowns = [await start_app(app), await start_app(on_redis)]
    row = digits_split()[1][0].astype("float32").tolist()
    chat = bench_policy_proxy.BODY.encode()
    paths = {
        "chat": (app, "/v1/chat/completions", chat, await new_key(app, "bench")),
        "chat_redis": (on_redis, "/v1/chat/completions", chat, await new_key(on_redis, "bench")),
        "tensors": (
            app,
            "/v2/models/digits/infer",
            json.dumps(
                {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": row}]}
            ).encode(),
            await new_key(app, "free"),
        ),
    }
    from gateway.http import openai_choices
    from gateway.http import requests as http
    from gateway.observe import metrics
    from policies.admission import Admission
    from policies.fair_queue import FairQueue
    from policies.stores.redis import RedisStore
    from policies.stores.sqlite.txn import SqliteTxn as _SqliteTxn
    from router.planner import Router

    # change -> [(where, attribute, as it is now, what it replaced), ...]
    changes = {
        "deadline": [(deadline.Deadline, "scope", deadline.Deadline.scope, _timeout_at_scope)],
        "response": [
            (openai_choices, "raw_json_response", openai_choices.raw_json_response, http.json_response)
        ],
        "one_choice": [(openai_choices, "collect_choices", openai_choices.collect_choices, _gather_choices)],
        "queue": [(FairQueue, "_can_pass_through", FairQueue._can_pass_through, _never_pass_through)],
        "store": [
            (_SqliteTxn, name, getattr(_SqliteTxn, name), replaced)
            for name, replaced in (
                ("adjust_buckets", _read_then_write_buckets),
                ("lease_count", _delete_then_count_leases),
                ("remove_lease", _remove_one_lease),
            )
        ],
        "redis": [(RedisStore, "_send", RedisStore._send, _redis_py_pipeline_send)],
        "metrics": [(metrics, "child", metrics.child, _labels_each_time)],
        "admit_at_once": [(Admission, "admit_at_once", Admission.admit_at_once, _always_through_the_store)],
        "one_route": [(Router, "plan", Router.plan, _always_through_the_bucket)],
    }
    missing = set(CHANGES) ^ changes.keys()
    if missing:
        raise RuntimeError(f"CHANGES and the switch table disagree on {sorted(missing)}")

    def switch(state: str) -> None:
        for name, swaps in changes.items():
            keep = state.startswith("after") or state == f"only_{name}"
            for where, attribute, now, replaced in swaps:
                setattr(where, attribute, now if keep else replaced)

    measured = {}
    try:
        for name, (target, path, body, headers) in paths.items():
            for _ in range(300):  # warm: caches, the runtime, the key's record, the store
                status, answer = await call(target, path, body, headers)
                if status != 200:
                    raise RuntimeError(f"{name} did not answer: {status} {answer[:200]!r}")

            async def request(
                target: Any = target, path: str = path, body: bytes = body, headers: list = headers
            ) -> None:
                await call(target, path, body, headers)

            print(name, flush=True)
            measured[name] = await run_rounds(STATES, switch, request, args.rounds, args.requests)
    finally:
        switch("after")
        for shutdown in shutdowns:
            await shutdown()
    return measured


def summarize(rounds: list[dict]) -> dict:
    import statistics

    return {
        "cpu_us_per_request": {
            s: statistics.median(r[s]["cpu_us_per_request"] for r in rounds) for s in STATES
        },
        "against_before": {s: paired(rounds, s, "before") for s in STATES if s != "before"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--requests", type=int, default=20, help="requests a state serves per round")
    args = parser.parse_args()
    upstream_port = bench_policy_proxy.free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_policy_proxy", "--upstream", str(upstream_port)], cwd=ROOT
    )
    try:
        bench_policy_proxy.wait_until(
            lambda: bench_policy_proxy.port_open(upstream_port), upstream, "upstream", 10
        )
        import uvloop

        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            redis_url, _ = bench_policy_proxy.start_redis(Path(tmp), stack)
            measured = uvloop.run(measure(args, Path(tmp), upstream_port, redis_url))
    finally:
        bench_policy_proxy.stop(upstream)
    out = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": vars(args),
        "median": {name: summarize(rounds) for name, rounds in measured.items()},
        "rounds": measured,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "hot_path_inprocess.json").write_text(json.dumps(out, indent=2))
    from bench.plotting import figure, save

    fig, ax = figure(size=(9, 4))
    names = list(out["median"])
    shown = STATES[1:]
    width = 0.8 / len(shown)
    for offset, state in enumerate(shown):
        found = [out["median"][n]["against_before"][state] for n in names]
        diff = [f["difference_us"] for f in found]
        errors = [
            [d - f["difference_us_95"][0] for d, f in zip(diff, found, strict=True)],
            [f["difference_us_95"][1] - d for d, f in zip(diff, found, strict=True)],
        ]
        ax.bar(
            [i + width * offset for i in range(len(names))], diff, width, yerr=errors, capsize=3, label=state
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.axhline(0, color="#333", linewidth=0.8)
    ax.set_ylabel("CPU a request against before (us; median of paired rounds, 95 %)")
    ax.set_title("The hot path's changes, in process")
    ax.legend(fontsize=8)
    save(fig, RESULTS / "hot_path_inprocess.png")
    print(json.dumps(out["median"], indent=1))


if __name__ == "__main__":
    main()
