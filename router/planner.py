"""Per request: which deployment serves, which are fallbacks, which only watch (shadows)."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import msgspec

from backends.errors import ModelNotFound
from policies.principal import Principal
from router.hashing import bucket_of, pick_weighted
from router.spec import ModelConfig


class Plan(msgspec.Struct, frozen=True):
    model: str
    #: the deployment to try first
    primary: str
    #: tried in order when the primary is unhealthy or fails before sending anything
    fallbacks: tuple[str, ...]
    #: deployments that get a copy after the answer is sent; never affect the caller
    shadows: tuple[str, ...]
    #: the explicit version asked for (or resolved from a label), else None
    version: str | None = None


def split_model_name(name: str) -> tuple[str, str | None, str | None]:
    """`model`, `model:version` or `model@label` -> (model, version, label)."""
    if "@" in name:
        model, _, label = name.partition("@")
        return model, None, label or None
    if ":" in name:
        model, _, version = name.partition(":")
        return model, version or None, None
    return name, None, None


class Router:
    """Routes logical model names to deployments.

    Args:
        models: the `models:` section.
        is_healthy: whether a deployment can take a request now (ready, circuit closed).
        rng: source of randomness for shadow sampling (injected in tests).
    """

    def __init__(
        self,
        models: Mapping[str, ModelConfig],
        is_healthy: Callable[[str], bool],
        rng: random.Random | None = None,
    ) -> None:
        self._models = dict(models)
        self._is_healthy = is_healthy
        self._rng = rng or random.Random()

    def update(self, models: Mapping[str, ModelConfig]) -> None:
        self._models = dict(models)

    def names(self) -> list[str]:
        return sorted(self._models)

    def get(self, model: str) -> ModelConfig:
        spec = self._models.get(model)
        if spec is None:
            raise ModelNotFound(f"model {model!r} does not exist")
        return spec

    def versions(self, model: str) -> list[str]:
        return sorted(self.get(model).versions)

    def resolve_version(self, model: str, version: str | None, label: str | None) -> str | None:
        spec = self.get(model)
        if label is not None:
            version = spec.labels.get(label)
            if version is None:
                raise ModelNotFound(f"model {model!r} has no label {label!r}")
        if version is not None and version not in spec.versions:
            raise ModelNotFound(f"model {model!r} has no version {version!r}")
        return version

    def _sticky_key(
        self, spec: ModelConfig, principal: Principal | None, headers: Mapping[str, str]
    ) -> str | None:
        if spec.sticky == "tenant":
            return principal.tenant if principal else None
        if spec.sticky == "key":
            return principal.key_id if principal else None
        if spec.sticky.startswith("header:"):
            return headers.get(spec.sticky.removeprefix("header:").lower())
        return None

    def plan(
        self,
        model: str,
        *,
        version: str | None = None,
        label: str | None = None,
        principal: Principal | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Plan:
        """Choose the deployments for one request. Raises ModelNotFound for unknown names."""
        spec = self.get(model)
        version = self.resolve_version(model, version, label)
        if version is not None:
            primary = spec.versions[version]
            # An explicit version is a contract: fall back only to what the config lists.
            fallbacks = tuple(d for d in spec.fallback if d != primary)
        else:
            routes = [r for r in spec.routes if r.weight > 0]
            healthy = [r for r in routes if self._is_healthy(r.deployment)] or routes
            bucket = bucket_of(model, self._sticky_key(spec, principal, headers or {}))
            chosen = healthy[pick_weighted([r.weight for r in healthy], bucket)].deployment
            others = [r.deployment for r in routes if r.deployment != chosen]
            # configured fallbacks first, then the model's other routes, each once
            fallbacks = tuple(d for d in dict.fromkeys([*spec.fallback, *others]) if d != chosen)
            primary = chosen
        shadows: tuple[str, ...] = ()
        if spec.shadow is not None and self._rng.random() < spec.shadow.fraction:
            shadows = (spec.shadow.deployment,)
        return Plan(model=model, primary=primary, fallbacks=fallbacks, shadows=shadows, version=version)
