"""Checks of a config that msgspec's types cannot express (names, devices, providers, what a
fallback serves) and YAML syntax errors, each as one `ConfigError` line naming the path.

Kept apart from the decoding (`loading.py`) and the cross-section checks (`references.py`) so each
stays one concern.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import yaml

from backends.runtime.devices import device_problem as spec_device_problem
from backends.spec import DeploymentSpec


class Config(Protocol):
    """What these checks read of a decoded config (gateway.config.spec.Config has it)."""

    @property
    def deployments(self) -> Mapping[str, DeploymentSpec]: ...

    @property
    def models(self) -> Mapping[str, Any]: ...

    @property
    def graphs(self) -> Mapping[str, Any]: ...


class ConfigError(ValueError):
    """A config that cannot be served. The message is one line and names the path."""


#: a model name (`models:`, `graphs:`, LoRA adapters) as clients write it in a body and in a URL:
#: segments of letters, digits and `. _ -`, each starting with a letter or digit, joined by `/`.
#: No `:` or `@` (`model:version`, `model@label`), and no empty, `.` or `..` segment: HTTP clients
#: fold `a/../b` into `b` before sending, so such a name could be created but never addressed again.
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?:/[A-Za-z0-9][A-Za-z0-9._-]*)*")
MODEL_NAME_MAX = 128
MODEL_NAME_RULE = (
    "a model name is letters, digits and . _ - in segments joined by /, each segment starting with "
    f"a letter or digit, at most {MODEL_NAME_MAX} characters (no : or @, which name versions and labels)"
)


def model_name_problem(name: str) -> str | None:
    """Why `name` cannot be a model name (the rule, in one line), or None when it can."""
    if len(name) <= MODEL_NAME_MAX and _MODEL_NAME.fullmatch(name):
        return None
    return f"{name!r} is not a valid model name: {MODEL_NAME_RULE}"


def check_model_names(config: Config) -> None:
    """Every name clients call (models, graphs, declared adapters) follows the model-name rule."""
    named = [(f"$.models.{n}", n) for n in config.models]
    named += [(f"$.graphs.{n}", n) for n in config.graphs]
    named += [
        (f"$.deployments.{d}.adapters.{a}", a) for d, dep in config.deployments.items() for a in dep.adapters
    ]
    for path, name in named:
        problem = model_name_problem(name)
        if problem is not None:
            raise ConfigError(f"{problem} - at `{path}`")


def check_devices(config: Config) -> None:
    """Each deployment's `device` is one its backend knows (the rules live with each backend)."""
    for name, dep in config.deployments.items():
        if dep.device is None:
            continue
        problem = spec_device_problem(dep.backend, dep.device)
        if problem is not None:
            raise ConfigError(f"{problem} - at `$.deployments.{name}.device`")


def check_providers(config: Config) -> None:
    """ONNX Runtime provider names are ones ONNX Runtime knows (a typo would otherwise be dropped
    silently at load, the model running on another device than the config says)."""
    onnx = {n: d for n, d in config.deployments.items() if d.backend == "onnxruntime" and d.providers}
    if not onnx:
        return
    try:  # imported only when a config names providers: onnxruntime is an optional extra
        import onnxruntime
    except ImportError:
        return  # the deployment's load names the missing extra
    known = list(onnxruntime.get_all_providers())
    for name, dep in onnx.items():
        for i, provider in enumerate(dep.providers or []):
            if provider not in known:
                raise ConfigError(
                    f"unknown ONNX Runtime execution provider {provider!r}{_did_you_mean(provider, known)}; "
                    f"known: {', '.join(known)} - at `$.deployments.{name}.providers[{i}]`"
                )


def _did_you_mean(value: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def serves(dep: DeploymentSpec) -> frozenset[str]:
    """What a deployment can answer: `text` (completions, chat), `embeddings` or `tensors`."""
    if dep.backend in ("torch_llm", "openvino_llm"):
        return frozenset({"text"})
    if dep.backend == "remote" and dep.protocol == "openai":
        return frozenset({"text", "embeddings"})
    if dep.embedding is not None:
        return frozenset({"embeddings"})
    return frozenset({"tensors"})


def check_fallback_kinds(config: Config) -> None:
    """A model's fallback answers what its routes answer: a chat model falling back to a tensor
    deployment would turn every failover into a second error."""
    for model, spec in config.models.items():
        kinds = [serves(config.deployments[r.deployment]) for r in spec.routes]
        needed = frozenset.intersection(*kinds)
        if not needed:
            continue  # routes of mixed kinds: each request finds its kind among them
        for i, fallback in enumerate(spec.fallback):
            dep = config.deployments[fallback]
            if not serves(dep) & needed:
                raise ConfigError(
                    f"fallback {fallback!r} ({dep.backend}) serves only {_kinds(serves(dep))}, while the "
                    f"model's routes serve {_kinds(needed)}: a fallback must answer the same requests "
                    f"- at `$.models.{model}.fallback[{i}]`"
                )


def _kinds(kinds: frozenset[str]) -> str:
    return " and ".join(sorted(kinds))


def yaml_error(exc: yaml.YAMLError, text: str, source: str | None) -> ConfigError:
    """One line: the file, line and column, what is wrong, and the offending line's text."""
    where = f" in {source}" if source else ""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or "invalid YAML"
    if mark is None:
        return ConfigError(f"invalid YAML{where}: {problem}")
    lines = text.splitlines()
    line = mark.line
    # a problem found at the end of the input (an unclosed bracket) points past the last line:
    # show where the unclosed construct began, else the last line with text before the mark
    context = getattr(exc, "context_mark", None)
    if (line >= len(lines) or not lines[line].strip()) and context is not None:
        line = context.line
    while line > 0 and (line >= len(lines) or not lines[line].strip()):
        line -= 1
    shown = lines[line].strip() if line < len(lines) else ""
    shown = shown if len(shown) <= 120 else shown[:117] + "..."
    if not shown:
        near = ""
    elif line == mark.line:
        near = f": `{shown}`"
    else:
        near = f" (near line {line + 1}: `{shown}`)"
    return ConfigError(f"invalid YAML{where} at line {mark.line + 1}, column {mark.column + 1}: {problem}{near}")
