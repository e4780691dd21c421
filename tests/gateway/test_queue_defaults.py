"""The fair queue's defaults per deployment: VTC with a burst credit sized for tensor deployments
(rows per slot), none for text generation (tokens), and what a config sets kept as set."""

from __future__ import annotations

from pathlib import Path

from gateway.config import parse_config
from gateway.core.fleet.deployments import build_deployments
from policies.fair_queue.spec import TENSOR_BURST_PER_SLOT


def test_the_burst_credit_default_follows_the_deployment_kind(digits, tmp_path: Path) -> None:  # noqa: ANN001
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{t: {{}}}}
deployments:
  tensors: {{backend: onnxruntime, model: {digits.onnx_path}, queue: {{max_concurrency: 3}}}}
  text: {{backend: remote, url: "http://127.0.0.1:9", protocol: openai}}
  strict: {{backend: onnxruntime, model: {digits.onnx_path}, queue: {{vtc_burst: 0}}}}
models:
  a: {{routes: [{{deployment: tensors}}]}}
  b: {{routes: [{{deployment: text}}]}}
  c: {{routes: [{{deployment: strict}}]}}
""",
        base_dir=tmp_path,
        env={},
    )
    deps = build_deployments(config, {})
    assert deps["tensors"].queue.spec.vtc_burst == TENSOR_BURST_PER_SLOT * 3
    assert deps["text"].queue.spec.vtc_burst == 0.0
    assert deps["strict"].queue.spec.vtc_burst == 0.0  # set in the config: kept
