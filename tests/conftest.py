"""Shared fixtures: the demo digits model built once, an OpenAI upstream, running gateways."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import structlog

# triton's native library aborts the process when it is loaded after TensorFlow's (the other order
# works); this suite loads both (TF Serving tests, the Triton kernel tests), so triton goes first.
with contextlib.suppress(ImportError):
    import triton  # noqa: F401

from backends.demo_models.digits import DigitsModel, write_digits
from gateway.config import Config, parse_config
from gateway.http.app import create_app
from tests.openai_upstream import create_upstream
from tests.servers import serve_app

ADMIN_KEY = "test-admin-key-0123456789"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_KEY}"}
UPSTREAM_KEY = "upstream-secret"
# Many gateways run side by side in one session (and in subprocesses, which inherit this): the gRPC
# front door is off unless a test's config asks for it with `server.grpc_port` (tests/gateway/test_grpc.py).
os.environ["FLEETGATE_GRPC_PORT"] = "off"


@pytest.fixture(scope="session", autouse=True)
def _environment() -> Iterator[None]:
    os.environ["FLEETGATE_ADMIN_KEY"] = ADMIN_KEY
    os.environ["TEST_UPSTREAM_KEY"] = UPSTREAM_KEY
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    yield


@pytest.fixture(autouse=True)
def _logging_configuration() -> Iterator[None]:
    """Put structlog's configuration back after every test. A test that runs a `fleetgate` command
    in-process (`gateway.serve.cli.main`) points structlog at that test's captured stderr, which pytest
    closes afterwards: every later log line in the session would then raise."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="session")
def digits(tmp_path_factory: pytest.TempPathFactory) -> DigitsModel:
    """The demo digits MLP, trained on scikit-learn's digits and written as ONNX."""
    return write_digits(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def upstream_url() -> Iterator[str]:
    with serve_app(create_upstream()) as url:
        yield url


def gateway_yaml(digits: DigitsModel, upstream_url: str, state_url: str) -> str:
    return f"""
server: {{max_body_bytes: 65536}}
state: {{url: "{state_url}"}}
tenants:
  acme: {{weight: 2, limits: {{requests_per_minute: 100000}}}}
  other: {{models: ["echo*"]}}
deployments:
  digits-ort:
    backend: onnxruntime
    model: {digits.onnx_path}
    batching: {{max_batch_size: 32, max_delay_ms: 2}}
  digits-ort-plain:
    backend: onnxruntime
    model: {digits.onnx_path}
  echo-remote:
    backend: remote
    url: {upstream_url}
    protocol: openai
    model_name: echo-upstream
    api_key_env: TEST_UPSTREAM_KEY
  broken-remote:
    backend: remote
    url: {upstream_url}
    protocol: openai
    model_name: missing
    api_key_env: TEST_UPSTREAM_KEY
models:
  digits:
    routes: [{{deployment: digits-ort}}]
    versions: {{"1": digits-ort, "2": digits-ort-plain}}
    labels: {{stable: "1", plain: "2"}}
  echo:
    routes: [{{deployment: echo-remote}}]
  echo-broken:
    routes: [{{deployment: broken-remote}}]
"""


@dataclass
class Gateway:
    url: str
    config: Config
    #: a key of tenant `acme` (sees every model)
    key: str
    #: a key of tenant `other` (sees only echo*)
    other_key: str

    def headers(self, key: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {key or self.key}"}


def create_key(url: str, tenant: str, **extra: object) -> str:
    r = httpx.post(
        f"{url}/admin/keys",
        json={"tenant": tenant, **extra},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    r.raise_for_status()
    return r.json()["key"]


@pytest.fixture(scope="module")
def gateway(
    digits: DigitsModel, upstream_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    state = tmp_path_factory.mktemp("state") / "fleetgate.db"
    config = parse_config(gateway_yaml(digits, upstream_url, f"sqlite:///{state}"), base_dir=Path("."))
    with serve_app(create_app(config)) as url:
        yield Gateway(url=url, config=config, key=create_key(url, "acme"), other_key=create_key(url, "other"))
