"""Reading a config: YAML parsed, `${ENV}` interpolated, each named entry decoded alone (so an error
names it), the whole decoded into `Config`, relative paths resolved against the file's directory,
then every cross-section reference checked. `parse_config` and `load_config` are the entries.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from backends.sources import is_address
from backends.spec import with_choices
from gateway.config.checks import ConfigError, yaml_error
from gateway.config.references import check_references
from gateway.config.sources import check_forms
from gateway.config.spec import Config, DeploymentConfig
from policies.types import TenantSpec
from router.graphs import GraphConfig
from router.spec import ModelConfig

_ENV_PATTERN = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _interpolate(node: Any, path: str, env: dict[str, str]) -> Any:
    """Replace `${NAME}` in every string of the tree; a missing variable is an error."""
    if isinstance(node, str):

        def repl(match: re.Match[str]) -> str:
            name = match.group(1)
            if name not in env:
                raise ConfigError(f"environment variable {name} is not set - at `{path}`")
            return env[name]

        return _ENV_PATTERN.sub(repl, node)
    if isinstance(node, dict):
        return {k: _interpolate(v, f"{path}.{k}", env) for k, v in node.items()}
    if isinstance(node, list):
        return [_interpolate(v, f"{path}[{i}]", env) for i, v in enumerate(node)]
    return node


def _resolve(path: str | None, base_dir: Path) -> str | None:
    if path is None or os.path.isabs(path) or is_address(path):  # hf://, s3://, https:// stay as written
        return path
    return str((base_dir / path).resolve())


def _resolve_paths(config: Config, base_dir: Path) -> Config:
    deployments = {}
    for name, dep in config.deployments.items():
        embedding = dep.embedding
        if embedding is not None:
            embedding = msgspec.structs.replace(embedding, tokenizer=_resolve(embedding.tokenizer, base_dir))
        adapters = {adapter: str(_resolve(path, base_dir)) for adapter, path in dep.adapters.items()}
        deployments[name] = msgspec.structs.replace(
            dep, model=_resolve(dep.model, base_dir), embedding=embedding, adapters=adapters
        )
    state = config.state
    if state.url.startswith("sqlite:///") and not state.url.startswith("sqlite:////"):
        relative = state.url.removeprefix("sqlite:///")
        state = msgspec.structs.replace(state, url="sqlite:///" + str(_resolve(relative, base_dir)))
    batches = msgspec.structs.replace(config.batches, files_dir=str(_resolve(config.batches.files_dir, base_dir)))
    storage = msgspec.structs.replace(config.storage, cache_dir=_resolve(config.storage.cache_dir, base_dir))
    return msgspec.structs.replace(config, deployments=deployments, state=state, batches=batches, storage=storage)



def _rebase(message: str, prefix: str) -> str:
    """Point a msgspec error message, whose path starts at an entry, at the entry's place in the file."""
    if " - at `$" in message:
        return message.replace(" - at `$", f" - at `{prefix}", 1)
    return f"{message} - at `{prefix}`"


def _check_named_entries(raw: dict[str, Any]) -> None:
    """Decode each entry of the name -> entry sections alone, so an error names the entry.

    msgspec reports a path inside a dict value as `$.deployments[...]`; a user needs the name.
    """
    for section, kind in (
        ("tenants", TenantSpec),
        ("deployments", DeploymentConfig),
        ("models", ModelConfig),
        ("graphs", GraphConfig),
    ):
        entries = raw.get(section)
        if not isinstance(entries, dict):
            continue
        for name, entry in entries.items():
            try:
                msgspec.convert(entry, kind, strict=True)
            except msgspec.ValidationError as exc:
                raise ConfigError(_rebase(with_choices(str(exc), kind), f"$.{section}.{name}")) from None


def _default_grpc_port(raw: dict[str, Any], environ: Mapping[str, str]) -> None:
    """`server.grpc_port` from `FLEETGATE_GRPC_PORT` when the config does not set it."""
    value = environ.get("FLEETGATE_GRPC_PORT")
    server = raw.get("server")
    if value is None or (isinstance(server, dict) and "grpc_port" in server):
        return
    if server is None:
        server = raw["server"] = {}
    if not isinstance(server, dict):
        return  # refused by the decoder with its path
    if value.strip().lower() in ("off", "null", "none", ""):
        server["grpc_port"] = None
    elif value.strip().isdigit():
        server["grpc_port"] = int(value)
    else:
        raise ConfigError(f"FLEETGATE_GRPC_PORT must be a port number or `off`, got {value!r}")


def parse_config(
    text: str, *, base_dir: Path, env: dict[str, str] | None = None, source: str | None = None
) -> Config:
    """Decode and check a YAML config. Raises ConfigError with one line naming the path.

    `source` names the file in YAML syntax errors (`load_config` passes the path).
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise yaml_error(exc, text, source) from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("the config must be a mapping of sections - at `$`")
    environ = dict(os.environ) if env is None else env
    raw = _interpolate(raw, "$", environ)
    _default_grpc_port(raw, environ)
    _check_named_entries(raw)
    try:
        config = msgspec.convert(raw, Config, strict=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(with_choices(str(exc), Config)) from None
    unresolved, config = config, _resolve_paths(config, base_dir)
    check_forms(unresolved, config, base_dir)
    check_references(config)
    if config.server.workers > 1 and config.state.url.startswith("memory://"):
        raise ConfigError(
            "server.workers > 1 needs a shared state (sqlite:/// or redis://): with memory:// each "
            "worker would keep its own keys and limits - at `$.state.url`"
        )
    return config


def load_config(path: str | os.PathLike[str], env: dict[str, str] | None = None) -> Config:
    """Read, decode and check a config file."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {file}: {exc.strerror}") from None
    return parse_config(text, base_dir=file.resolve().parent, env=env, source=str(file))
