"""Which module implements which `backend:` name. Adapters are imported only when used."""

from __future__ import annotations

import importlib

from backends.base import Backend
from backends.spec import DeploymentSpec

#: backend name in the config -> module exposing `create(name, spec) -> Backend`
ADAPTERS: dict[str, str] = {
    "onnxruntime": "backends.onnxruntime",
    "openvino": "backends.openvino",
    "tfserving": "backends.tfserving",
    "remote": "backends.remote",
    "torch_llm": "backends.torch_llm.backend",
    "openvino_llm": "backends.openvino_llm.backend",
}


#: in-process tensor runtimes that can serve an `embedding:` encoder
EMBEDDING_BACKENDS = frozenset({"onnxruntime", "openvino"})


def create_backend(name: str, spec: DeploymentSpec) -> Backend:
    """Build (but do not load) the backend of one deployment.

    Raises:
        ValueError: the deployment's fields or options are invalid for its backend.
    """
    try:
        module = importlib.import_module(ADAPTERS[spec.backend])
    except ImportError as exc:
        raise ValueError(
            f"backend {spec.backend!r} cannot be imported ({exc}); is its extra installed?"
        ) from None
    backend = module.create(name, spec)
    if spec.embedding is None:
        return backend
    if spec.backend not in EMBEDDING_BACKENDS:
        raise ValueError(f"embedding: is served by {sorted(EMBEDDING_BACKENDS)} deployments, not {spec.backend}")
    from backends.embedding import EmbeddingAdapter

    return EmbeddingAdapter(backend, spec.embedding)
