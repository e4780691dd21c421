"""A deployment whose model is still being fetched declares what its backend will serve, taken from
its adapter's class (so a new generative backend is not mistaken for a tensor one meanwhile)."""

from __future__ import annotations

import pytest

from backends.base import Capability
from backends.spec import DeploymentSpec, EmbeddingSpec
from gateway.core.fleet.pending import PendingBackend, expected_capabilities

G, T, E = Capability.GENERATE, Capability.TENSOR, Capability.EMBED


@pytest.mark.parametrize(
    ("backend", "embedding", "expected"),
    [
        ("torch_llm", False, {G}),
        ("openvino_llm", False, {G}),
        ("onnxruntime", False, {T}),
        ("openvino", False, {T}),
        ("onnxruntime", True, {T, E}),
        ("openvino", True, {T, E}),
    ],
)
def test_a_fetching_deployment_declares_its_backends_capabilities(backend: str, embedding: bool, expected: set[Capability]) -> None:
    spec = DeploymentSpec(
        backend=backend,  # type: ignore[arg-type]
        model="hf://acme/model",
        embedding=EmbeddingSpec(tokenizer="hf://acme/tokenizer") if embedding else None,
    )
    stand_in = PendingBackend("d", spec)
    assert stand_in.capabilities == expected == expected_capabilities(spec)
    assert stand_in.ready is False
