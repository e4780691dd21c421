"""A gateway for the console tests: served from a config file (so the console's reload has a file to
re-read), real ONNX Runtime deployments of the digits model, real SQLite state."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from backends.demo_models.digits import DigitsModel
from gateway.config import load_config
from gateway.http.app import create_app
from tests.servers import serve_app

#: a tenant whose name is markup: every page must show it as text
SCRIPT_TENANT = "<script>document.title='owned'</script>"
BODY = {"instances": [[0.0] * 64]}


def console_yaml(model: Path, state: Path, weight_a: int = 70) -> str:
    return f"""
state: {{url: "sqlite:///{state}"}}
tenants:
  acme:
    weight: 2
    limits: {{requests_per_minute: 100000, max_concurrency: 16}}
    quotas: {{requests_per_day: 1000000}}
  "{SCRIPT_TENANT}": {{models: ["digits*"]}}
deployments:
  digits-a: {{backend: onnxruntime, model: {model}}}
  digits-b: {{backend: onnxruntime, model: {model}}}
models:
  digits:
    routes: [{{deployment: digits-a, weight: {weight_a}}}, {{deployment: digits-b, weight: {100 - weight_a}}}]
    sticky: none
  digits-shadowed:
    routes: [{{deployment: digits-a}}]
    shadow: {{deployment: digits-b, fraction: 1.0}}
  digits-canary:
    routes: [{{deployment: digits-a, weight: 90}}, {{deployment: digits-b, weight: 10, canary: true}}]
graphs:
  digits-cascade:
    steps:
      first: {{model: digits, inputs: {{input: request.input}}}}
      second: {{model: digits-canary, inputs: {{input: request.input}},
                when: {{tensor: first.probabilities, reduce: max, below: 0.5, per_row: true}}}}
    outputs: {{probabilities: [second.probabilities, first.probabilities]}}
"""


@dataclass
class ConsoleGateway:
    url: str
    config_path: Path
    model_path: Path
    state_path: Path

    @property
    def ui(self) -> str:
        return f"{self.url}/admin/ui"

    def write_config(self, weight_a: int) -> None:
        self.config_path.write_text(console_yaml(self.model_path, self.state_path, weight_a))


@pytest.fixture(scope="module")
def console_gateway(
    digits: DigitsModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConsoleGateway]:
    folder = tmp_path_factory.mktemp("console")
    gw = ConsoleGateway("", folder / "gateway.yaml", digits.onnx_path, folder / "state.db")
    gw.write_config(70)
    with serve_app(create_app(load_config(gw.config_path), config_path=gw.config_path)) as url:
        gw.url = url
        yield gw


def infer(url: str, key: str, model: str = "digits") -> httpx.Response:
    return httpx.post(
        f"{url}/v1/models/{model}:predict", json=BODY, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )
