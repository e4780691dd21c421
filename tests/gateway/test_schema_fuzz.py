"""Schema-driven fuzzing of the running gateway: every operation of /openapi.json, with a tenant key.

Bounded for CI (a few examples per operation); bench/fuzz_gateway.py runs the same much longer.
The property: no answer is a 5xx (an internal error), whatever a client sends; the process lives.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from backends.demo_models.digits import DigitsModel
from backends.demo_models.tiny_llama import write_tiny_llama
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import create_key
from tests.servers import serve_app

#: examples per operation in CI (about 30 operations)
EXAMPLES = 12


def fuzz_config(digits: DigitsModel, llama: Path, upstream_url: str, files: Path) -> str:
    """Every backend kind that runs without extra servers: ORT, the LLM engine, a remote upstream."""
    return f"""
server: {{request_timeout_s: 20}}
state: {{url: "memory://"}}
batches: {{files_dir: "{files}"}}
tenants: {{fuzz: {{limits: {{requests_per_minute: 1000000}}}}, other: {{}}}}
deployments:
  digits: {{backend: onnxruntime, model: {digits.onnx_path}, batching: {{max_batch_size: 16, max_delay_ms: 1}}}}
  llm: {{backend: torch_llm, model: {llama}, device: cpu, options: {{max_model_len: 64, max_num_seqs: 4}}}}
  echo: {{backend: remote, url: "{upstream_url}", protocol: openai, model_name: echo-upstream,
          api_key_env: TEST_UPSTREAM_KEY}}
models:
  digits: {{routes: [{{deployment: digits}}], versions: {{"1": digits}}, labels: {{stable: "1"}}}}
  tiny: {{routes: [{{deployment: llm}}]}}
  echo: {{routes: [{{deployment: echo}}]}}
"""


@pytest.fixture(scope="module")
def fuzz_gateway(digits, upstream_url, tmp_path_factory) -> Iterator[tuple[str, str]]:  # type: ignore[no-untyped-def]
    llama = write_tiny_llama(tmp_path_factory.mktemp("llm") / "tiny-llama")
    files = tmp_path_factory.mktemp("files")
    config = parse_config(fuzz_config(digits, llama, upstream_url, files), base_dir=Path("."))
    with serve_app(create_app(config)) as url:
        yield url, create_key(url, "fuzz")


def steer(case) -> None:  # type: ignore[no-untyped-def]
    """Point three cases in four at models that exist, so the fuzzing reaches decoders and runtimes.

    Generated names would almost all be unknown models (a 404 before any body is looked at); the
    generated bodies, shapes, data and parameters are kept as they are.
    """
    seed = hash(repr(case.path_parameters) + repr(case.body)) % 4
    if seed == 0:
        return  # unknown names stay: the 404 paths are fuzzed too
    params = case.path_parameters or {}
    path = case.operation.path
    text_route = path in ("/v1/completions", "/v1/chat/completions")
    model = ("tiny" if seed == 1 else "echo") if text_route else "digits"
    if "model" in params:
        params["model"] = model
    if "version" in params:
        params["version"] = "1"
    if "label" in params:
        params["label"] = "stable"
    if "segment" in params:
        verb_of = "1" if "/versions/" in path else "stable" if "/labels/" in path else "digits"
        params["segment"] = f"{verb_of}:predict"
    if isinstance(case.body, dict) and text_route:
        case.body["model"] = model


def test_no_request_gets_a_server_error(fuzz_gateway) -> None:  # type: ignore[no-untyped-def]
    url, key = fuzz_gateway
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 24  # every client route is in the document
    # injected dependencies (the core, the call) are no client parameters
    document = httpx.get(f"{url}/openapi.json").json()
    names = {p["name"] for ops in document["paths"].values() for op in ops.values() for p in op.get("parameters", [])}
    assert not names & {"core", "call", "request"}, names

    for operation in operations:

        @settings(
            max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(case=operation.as_strategy())
        def exercise(case) -> None:  # type: ignore[no-untyped-def]
            steer(case)
            response = case.call(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
            if response.status_code >= 500 or "Traceback" in response.text:
                failures.append(
                    f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:300]}"
                )

        exercise()
    assert httpx.get(f"{url}/health/live", timeout=10).status_code == 200  # the process lives
    assert not failures, "\n".join(failures[:20])
