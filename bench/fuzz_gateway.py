"""A long schema-driven fuzzing run against a running gateway: the CI test's property, many more cases.

Serves the same gateway as tests/gateway/test_schema_fuzz.py (ONNX Runtime digits, the torch_llm
engine on a tiny random Llama, a remote OpenAI upstream; memory state) in this process, loads its
/openapi.json with schemathesis and sends `--examples` generated requests per operation with a
tenant key. Records every answer's status per operation, every 5xx or traceback, and whether the
process still answers /health/live after each operation.

Writes bench/results/fuzz.json. Run: `.venv/bin/python -m bench.fuzz_gateway [--examples 200]`.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("FLEETGATE_ADMIN_KEY", "fuzz-admin-key")
os.environ.setdefault("TEST_UPSTREAM_KEY", "upstream-secret")

import httpx  # noqa: E402
import schemathesis  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

from backends.demo_models.digits import write_digits  # noqa: E402
from backends.demo_models.tiny_llama import write_tiny_llama  # noqa: E402
from gateway.config import parse_config  # noqa: E402
from gateway.http.app import create_app  # noqa: E402
from tests.gateway.test_schema_fuzz import fuzz_config, steer  # noqa: E402
from tests.openai_upstream import create_upstream  # noqa: E402
from tests.servers import serve_app  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def _exerciser(operation, url: str, key: str, examples: int, statuses: Counter[int], errors: list):  # type: ignore[no-untyped-def]
    """A hypothesis test that sends `examples` generated requests of one operation, recording answers."""

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def exercise(case) -> None:  # type: ignore[no-untyped-def]
        steer(case)
        response = case.call(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
        statuses[response.status_code] += 1
        if response.status_code >= 500 or "Traceback" in response.text:
            errors.append({"operation": operation.label, "status": response.status_code, "body": response.text[:300]})

    return exercise


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=200, help="generated requests per operation")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp())
    digits = write_digits(tmp)
    llama = write_tiny_llama(tmp / "tiny-llama")
    files = tmp / "files"  # the batch API's uploads (tests/gateway/test_schema_fuzz.py)
    files.mkdir()
    report: dict = {"examples_per_operation": args.examples, "operations": {}, "server_errors": []}
    started = time.perf_counter()
    with serve_app(create_upstream()) as upstream, serve_app(
        create_app(parse_config(fuzz_config(digits, llama, upstream, files), base_dir=Path(".")))
    ) as url:
        key = httpx.post(
            f"{url}/admin/keys",
            json={"tenant": "fuzz"},
            headers={"Authorization": f"Bearer {os.environ['FLEETGATE_ADMIN_KEY']}"},
        ).json()["key"]
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        for result in schema.get_all_operations():
            operation = result.ok()
            statuses: Counter[int] = Counter()
            exercise = _exerciser(operation, url, key, args.examples, statuses, report["server_errors"])
            exercise()
            alive = httpx.get(f"{url}/health/live", timeout=10).status_code == 200
            report["operations"][operation.label] = {"statuses": dict(statuses), "alive_after": alive}
            print(operation.label, dict(statuses), "alive" if alive else "DEAD", flush=True)
    report["requests"] = sum(sum(o["statuses"].values()) for o in report["operations"].values())
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["responses_5xx"] = len(report["server_errors"])
    report["process_alive_throughout"] = all(o["alive_after"] for o in report["operations"].values())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fuzz.json").write_text(json.dumps(report, indent=1))
    from bench.plots import plot_fuzz  # the PNG beside the JSON (bench/plots.py)

    plot_fuzz(report, RESULTS / "fuzz.png")
    print(json.dumps({k: report[k] for k in ("requests", "seconds", "responses_5xx", "process_alive_throughout")}))


if __name__ == "__main__":
    main()
