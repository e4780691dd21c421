"""Cross-section checks of a decoded config that msgspec cannot do: the deployments a model names,
route weights, canaries and labels, LoRA adapters and graphs, each as one `ConfigError` naming the path.

`check_references` is the one entry; the per-field checks it calls live in `gateway/config/checks.py`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from backends.base import ModelMetadata
from backends.runtime.signatures import read_signature
from backends.sources import is_address
from gateway.config.checks import (
    ConfigError,
    check_devices,
    check_fallback_kinds,
    check_model_names,
    check_providers,
)
from gateway.config.spec import Config
from router.graph_types import check_graph_tensors
from router.graphs import check_graph
from router.spec import ModelConfig

#: route weights of one model must add up to this (percent)
WEIGHT_TOTAL = 100.0


def _check_model(model: str, spec: ModelConfig, names: Mapping[str, object]) -> None:
    base = f"$.models.{model}"
    refs = [(f"{base}.routes[{i}].deployment", r.deployment) for i, r in enumerate(spec.routes)]
    refs += [(f"{base}.fallback[{i}]", d) for i, d in enumerate(spec.fallback)]
    refs += [(f"{base}.versions.{v}", d) for v, d in spec.versions.items()]
    if spec.shadow is not None:
        refs.append((f"{base}.shadow.deployment", spec.shadow.deployment))
    for path, name in refs:
        if name not in names:
            raise ConfigError(f"unknown deployment {name!r} - at `{path}`")
    # routes that only the shadow uses take no traffic of their own; the others must take it all
    served = [r for r in spec.routes if spec.shadow is None or r.deployment != spec.shadow.deployment]
    if sum(r.weight for r in served) <= 0:
        raise ConfigError(f"no route of the model has a positive weight - at `{base}.routes`")
    total = sum(r.weight for r in spec.routes)
    if len(spec.routes) > 1 and abs(total - WEIGHT_TOTAL) > 1e-6:
        raise ConfigError(f"route weights add up to {total:g}, not {WEIGHT_TOTAL:g} - at `{base}.routes`")
    canaries = spec.canaries()
    if canaries and all(r.deployment in canaries for r in spec.routes if r.weight > 0):
        raise ConfigError(f"a canary needs a baseline route (one that is not a canary) - at `{base}.routes`")
    for label, version in spec.labels.items():
        if version not in spec.versions:
            raise ConfigError(f"label points to unknown version {version!r} - at `{base}.labels.{label}`")


def check_references(config: Config) -> None:
    """Cross-section checks msgspec cannot do: names, weights, devices, files."""
    check_model_names(config)
    for model, spec in config.models.items():
        _check_model(model, spec, config.deployments)
    check_fallback_kinds(config)
    # before the files: a config checked away from its models still gets these checked
    check_devices(config)
    check_providers(config)
    for name, dep in config.deployments.items():
        if dep.model is not None and not is_address(dep.model) and not os.path.exists(dep.model):
            raise ConfigError(f"model file {dep.model} does not exist - at `$.deployments.{name}.model`")
    _check_adapters(config)
    _check_graphs(config)
    for name, dep in config.deployments.items():
        if "quantization" in dep.options and dep.backend != "torch_llm":
            raise ConfigError(
                f"{dep.backend} has no quantization option: serve an INT8 model file instead (for OpenVINO, "
                f"`fleetgate quantize` writes one) - at `$.deployments.{name}.options.quantization`"
            )


def _check_adapters(config: Config) -> None:
    """Adapter names are model names: unique, not also a `models:` entry, on a torch_llm base."""
    owner: dict[str, str] = {}
    for name, dep in config.deployments.items():
        for adapter, path in dep.adapters.items():
            where = f"$.deployments.{name}.adapters.{adapter}"
            if dep.backend != "torch_llm":
                raise ConfigError(f"LoRA adapters are served by torch_llm deployments only - at `{where}`")
            if adapter in config.models:
                raise ConfigError(
                    f"adapter {adapter!r} is also a model in `models:`; an adapter is a model of its own, "
                    f"pick another name - at `{where}`"
                )
            if adapter in owner:
                raise ConfigError(
                    f"adapter {adapter!r} is also declared by deployment {owner[adapter]!r} - at `{where}`"
                )
            if not is_address(path) and not os.path.isdir(path):
                raise ConfigError(f"adapter folder {path} does not exist - at `{where}`")
            owner[adapter] = name


def _check_graphs(config: Config) -> None:
    """Graph names are model names; each graph's structure, then its tensors where the model files
    tell their signatures (one line per problem, naming the path)."""
    adapters = {a for dep in config.deployments.values() for a in dep.adapters}
    signatures: dict[str, ModelMetadata | None] = {}

    def signature(model: str) -> ModelMetadata | None:
        if model not in signatures:
            routes = [r.deployment for r in config.models[model].routes]
            found = (read_signature(config.deployments[d]) for d in routes if d in config.deployments)
            signatures[model] = next((s for s in found if s is not None), None)
        return signatures[model]

    for name, graph in config.graphs.items():
        if name in config.models or name in adapters:
            raise ConfigError(
                f"graph {name!r} is also a model name; pick another name - at `$.graphs.{name}`"
            )
        try:
            check_graph(name, graph, config.models)
            check_graph_tensors(name, graph, signature)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        for step_name, step in graph.steps.items():
            if _generates_text(config, step.model):
                raise ConfigError(
                    f"model {step.model!r} generates text; a graph step calls a tensor model "
                    f"- at `$.graphs.{name}.steps.{step_name}.model`"
                )


def _generates_text(config: Config, model: str) -> bool:
    """Whether every route of `model` is a text-generation deployment (an LLM, an OpenAI upstream)."""
    routes = [config.deployments.get(r.deployment) for r in config.models[model].routes]
    return all(
        d is not None
        and (d.backend in ("torch_llm", "openvino_llm") or (d.backend == "remote" and d.protocol == "openai"))
        for d in routes
    )
