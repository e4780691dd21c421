"""LoRA adapters as models: each adapter of a torch_llm deployment is a model name clients call.

An adapter named `acme-support` on deployment `llama-8b` is served as the model `acme-support`: one
route to `llama-8b`, no fallback (another base would answer with another model), tenant-scoped by
the same globs as every model (a tenant whose `models:` do not match the name neither sees nor calls
it), with its own limits, quotas and usage rows. The core passes the adapter to the backend in
`GenerateRequest.adapter`. Adapters are declared per deployment (`adapters: {name: folder}`) or
loaded at run time (`POST /admin/deployments/{name}/adapters`, gateway/admin/adapters.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.config import Config
from router.spec import ModelConfig, RouteConfig


def declared_adapters(config: Config) -> dict[str, str]:
    """Adapter model name -> its deployment, as the config declares them."""
    return {adapter: name for name, dep in config.deployments.items() for adapter in dep.adapters}


def adapter_model(deployment: str) -> ModelConfig:
    """The routing of an adapter model: its base deployment, and nothing else."""
    return ModelConfig(routes=[RouteConfig(deployment=deployment)], sticky="none")


def served_models(config: Config, adapters: Mapping[str, str]) -> dict[str, ModelConfig]:
    """The config's `models:` plus one model per adapter (config names win; the admin API and
    reload refuse an adapter name that a config model holds)."""
    out = {name: adapter_model(dep) for name, dep in adapters.items()}
    out.update(config.models)
    return out


def base_model_of(config: Config, deployment: str) -> str:
    """The model clients call for an adapter's base: the first model routing to its deployment,
    else the deployment's own name (OpenAI's `parent` of the adapter model)."""
    for name, spec in config.models.items():
        if any(r.deployment == deployment for r in spec.routes):
            return name
    return deployment
