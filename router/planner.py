"""Per request: which deployment serves, which are fallbacks, which only watch (shadows).

Choosing the primary of a request without an explicit version:

1. The routes of positive weight are cut into slices (`router.hashing`): one slice per route, or,
   with `balance: least_wait`, one slice per group of equally weighted non-canary routes (a pool).
2. The caller's sticky bucket picks a slice over the configured weights.
3. If that slice cannot serve (its canary was rolled back, or none of its deployments is healthy),
   the caller is re-bucketed over the slices that can. Callers of every other slice never move,
   so a canary rollback or an outage reshuffles only the callers it has to.
4. In a pool, the member with the least expected wait (`router.load`) serves; ties go by bucket.

A model with a single route of positive weight skips all four: nothing can choose another primary
there, so its plan is made once per config (`_fixed_plan`) and only its shadow is sampled per request.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

import msgspec

from backends.errors import ModelNotFound
from policies.principal import Principal
from router.canary import CanaryMonitor
from router.hashing import bucket_of, pick_weighted, rebucket
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


class _Slice(msgspec.Struct):
    weight: float
    members: list[str]


def _fixed_plan(model: str, spec: ModelConfig) -> Plan | None:
    """The plan of every versionless request of a model with one route of positive weight, or None.

    No bucket, canary verdict or health can choose another primary there (with that one route down
    or rolled back the gateway still tries it, and reports it), so the plan is made once per config
    and shared: most models have one route, and the bucket's hash and the slices cost a tensor
    request 24 us of CPU (`bench/bench_hot_path_inprocess.py`, the `one_route` change).
    """
    routes = [r for r in spec.routes if r.weight > 0]
    if len(routes) != 1:
        return None
    primary = routes[0].deployment
    fallbacks = tuple(d for d in dict.fromkeys(spec.fallback) if d != primary)
    return Plan(model=model, primary=primary, fallbacks=fallbacks, shadows=())


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
        canaries: the canary watch (one with the real clock is made when omitted).
        expected_wait: seconds a new request would wait on a deployment (for `least_wait` pools);
            without it every pool member looks idle and ties go by bucket.
    """

    def __init__(
        self,
        models: Mapping[str, ModelConfig],
        is_healthy: Callable[[str], bool],
        rng: random.Random | None = None,
        canaries: CanaryMonitor | None = None,
        expected_wait: Callable[[str], float] | None = None,
    ) -> None:
        self._is_healthy = is_healthy
        self._rng = rng or random.Random()
        self.canaries = canaries or CanaryMonitor()
        self._expected_wait = expected_wait or (lambda name: 0.0)
        self._models: dict[str, ModelConfig] = {}
        self._fixed: dict[str, Plan] = {}
        self.update(models)

    def update(self, models: Mapping[str, ModelConfig]) -> None:
        """Swap the models (reload). Canary rollbacks of routes that stay canaries are kept."""
        self._models = dict(models)
        self._fixed = {name: plan for name, spec in self._models.items() if (plan := _fixed_plan(name, spec))}
        self.canaries.configure(self._models)

    def names(self) -> list[str]:
        return sorted(self._models)

    def get(self, model: str) -> ModelConfig:
        spec = self._models.get(model)
        if spec is None:
            raise ModelNotFound(f"model {model!r} does not exist")
        return spec

    def versions(self, model: str) -> list[str]:
        return sorted(self.get(model).versions)

    def effective_weights(self, model: str) -> dict[str, float]:
        """Route weights as the router applies them now: a rolled-back canary weighs 0."""
        return {
            r.deployment: 0.0 if self.canaries.rolled_back(model, r.deployment) else r.weight
            for r in self.get(model).routes
        }

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

    def _slices(self, model: str, spec: ModelConfig) -> list[_Slice]:
        routes = [r for r in spec.routes if r.weight > 0]
        if spec.balance == "weighted":
            return [_Slice(r.weight, [r.deployment]) for r in routes]
        slices: list[_Slice] = []
        pools: dict[float, _Slice] = {}
        for r in routes:
            if r.canary_policy is not None:  # a canary is judged alone, never pooled
                slices.append(_Slice(r.weight, [r.deployment]))
            elif r.weight in pools:
                pools[r.weight].weight += r.weight
                pools[r.weight].members.append(r.deployment)
            else:
                pools[r.weight] = _Slice(r.weight, [r.deployment])
                slices.append(pools[r.weight])
        return slices

    def _choose(self, model: str, spec: ModelConfig, bucket: int) -> tuple[str, list[str]]:
        """The primary and the other live routes (see the module docstring)."""
        slices = self._slices(model, spec)
        live = [
            _Slice(s.weight, [d for d in s.members if not self.canaries.rolled_back(model, d)])
            for s in slices
        ]
        live = [s for s in live if s.members] or slices  # only canaries, all rolled back: serve anyway
        others = [d for s in live for d in s.members]
        chosen = slices[pick_weighted([s.weight for s in slices], bucket)]
        members = [d for d in chosen.members if d in others and self._is_healthy(d)]
        if not members:
            usable = [
                _Slice(s.weight, healthy)
                for s in live
                if (healthy := [d for d in s.members if self._is_healthy(d)])
            ] or live  # nothing healthy: let the gateway report it
            bucket = rebucket(bucket)
            members = usable[pick_weighted([s.weight for s in usable], bucket)].members
        if len(members) == 1:
            return members[0], others
        waits = [(self._expected_wait(d), d) for d in members]
        least = min(w for w, _ in waits)
        ties = [d for w, d in waits if w == least]
        return ties[bucket % len(ties)], others

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
        if version is None and label is None and (fixed := self._fixed.get(model)) is not None:
            shadows = self._sampled_shadows(spec)
            return msgspec.structs.replace(fixed, shadows=shadows) if shadows else fixed
        return self._plan_by_bucket(model, spec, version, label, principal, headers)

    def _plan_by_bucket(
        self,
        model: str,
        spec: ModelConfig,
        version: str | None,
        label: str | None,
        principal: Principal | None,
        headers: Mapping[str, str] | None,
    ) -> Plan:
        """`plan` through the caller's bucket (steps 1 to 4 of the module docstring)."""
        version = self.resolve_version(model, version, label)
        if version is not None:
            primary = spec.versions[version]
            # An explicit version is a contract: fall back only to what the config lists.
            fallbacks = tuple(d for d in spec.fallback if d != primary)
        else:
            bucket = bucket_of(model, self._sticky_key(spec, principal, headers or {}))
            primary, others = self._choose(model, spec, bucket)
            # configured fallbacks first, then the model's other live routes, each once
            fallbacks = tuple(d for d in dict.fromkeys([*spec.fallback, *others]) if d != primary)
        shadows = self._sampled_shadows(spec)
        return Plan(model=model, primary=primary, fallbacks=fallbacks, shadows=shadows, version=version)

    def _sampled_shadows(self, spec: ModelConfig) -> tuple[str, ...]:
        """The shadow deployment for this request, drawn at the model's shadow fraction (both paths)."""
        if spec.shadow is not None and self._rng.random() < spec.shadow.fraction:
            return (spec.shadow.deployment,)
        return ()
