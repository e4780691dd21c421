"""Model addresses in the config: every field that takes a model (a deployment's `model`, its
embedding `tokenizer`, its LoRA `adapters`), checked in form at load time and resolved at their
stores by `check-config` and `fleetgate pull` (backends/sources, docs/model_sources.md)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import msgspec

from backends.sources import ModelSources, SourceError, is_address, looks_like_repo_id, parse_address
from backends.sources.cache import Manifest
from backends.spec import DeploymentSpec
from gateway.config.checks import ConfigError
from gateway.config.spec import Config


def spec_models(spec: DeploymentSpec) -> list[tuple[str, str]]:
    """(field path inside the deployment, value) of every field of `spec` that names a model."""
    out = [(".model", spec.model)] if spec.model is not None else []
    if spec.embedding is not None:
        out.append((".embedding.tokenizer", spec.embedding.tokenizer))
    out += [(f".adapters.{name}", path) for name, path in spec.adapters.items()]
    return out


def config_addresses(config: Config) -> list[tuple[str, str]]:
    """(path in the file, address) of every model address of the config, in file order."""
    return [
        (f"$.deployments.{name}{field}", value)
        for name, dep in config.deployments.items()
        for field, value in spec_models(dep)
        if is_address(value)
    ]


def suggest_repo(value: str, base_dir: Path, where: str) -> None:
    """A relative path that does not exist but reads like `org/name` is most likely a Hugging Face
    repository: say so before it becomes an absolute path nobody recognises."""
    if not is_address(value) and not os.path.isabs(value) and not (base_dir / value).exists() and looks_like_repo_id(value):
        raise ConfigError(
            f"model file {value} does not exist; for the Hugging Face repository write hf://{value} - at `{where}`"
        )


def check_forms(unresolved: Config, config: Config, base_dir: Path) -> None:
    """Each address parses; bare `org/name` paths (as written, before they were made absolute) get
    the `hf://` hint; in offline mode, each address is in the cache (no network: a missing model is
    refused before anything starts)."""
    for name, dep in unresolved.deployments.items():
        for field, value in spec_models(dep):
            suggest_repo(value, base_dir, f"$.deployments.{name}{field}")
    sources = ModelSources(config.storage)
    for where, text in config_addresses(config):
        try:
            address = parse_address(text)
            if sources.offline(address) and sources.cache.lookup(text) is None:
                sources.check(text)  # raises the offline refusal, naming what to run
        except SourceError as exc:
            raise ConfigError(f"{exc} - at `{where}`") from None


def resolve_all(config: Config, sources: ModelSources | None = None) -> list[str]:
    """Resolve every address at its store without downloading (`check-config`): one line per
    address, e.g. `hf://org/name -> 3f2a... (4 files, 12.5 MB)`. Raises ConfigError at the first
    address that cannot be served, naming its path."""
    sources = sources or ModelSources(config.storage)
    lines = []
    for where, text in config_addresses(config):
        try:
            found = sources.check(text)
        except SourceError as exc:
            raise ConfigError(f"{exc} - at `{where}`") from None
        if isinstance(found, Manifest):
            size, cached = found.size, ", cached (offline)"
        else:
            size, cached = found.total_bytes, ""
        lines.append(f"{text} -> {found.revision} ({len(found.files)} files, {size / 1e6:.1f} MB{cached})")
    return lines


def with_local_paths(spec: DeploymentSpec, local: Callable[[str], Path | None]) -> DeploymentSpec | None:
    """`spec` with each model address replaced by its folder in the cache (`local` answers None
    for an address it does not hold: then None, the deployment must be fetched first)."""
    paths: dict[str, str] = {}
    for _, value in spec_models(spec):
        if is_address(value):
            found = local(value)
            if found is None:
                return None
            paths[value] = str(found)
    if not paths:
        return spec
    embedding = spec.embedding
    if embedding is not None:
        embedding = msgspec.structs.replace(embedding, tokenizer=paths.get(embedding.tokenizer, embedding.tokenizer))
    adapters = {name: paths.get(path, path) for name, path in spec.adapters.items()}
    model = paths.get(spec.model, spec.model) if spec.model is not None else None
    return msgspec.structs.replace(spec, model=model, embedding=embedding, adapters=adapters)
