"""The `models:` section of the config: what clients ask for and which deployments serve it."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from backends.spec import SpecBase
from policies.pricing import Pricing


class CanaryConfig(SpecBase):
    """When a canary route is rolled back (its weight drops to 0 until an admin restores it).

    Every signal compares the canary with the model's baseline (its non-canary routes) over the same
    sliding window; the canary is judged only once it has `min_requests` outcomes in the window.
    """

    #: the canary's error rate may exceed the baseline's by at most this (0.1 = ten points); the same
    #: bound holds for its rate of caller errors (4xx answers, e.g. a changed input signature)
    max_error_rate: float = 0.05
    #: the canary's median latency may be at most this multiple of the baseline's (None = not checked)
    max_latency_ratio: float | None = 2.0
    #: the sliding window, in seconds
    window_s: float = 60.0
    #: outcomes of the canary needed in the window before it is judged
    min_requests: int = 20

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_error_rate <= 1.0:
            raise ValueError("max_error_rate must be in 0..1")
        ratio = self.max_latency_ratio
        if ratio is not None and not (math.isfinite(ratio) and ratio > 1.0):
            raise ValueError("max_latency_ratio must be a finite number > 1")
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            raise ValueError("window_s must be a finite number > 0")
        if self.min_requests < 1:
            raise ValueError("min_requests must be >= 1")


class RouteConfig(SpecBase):
    #: the deployment this route sends requests to
    deployment: str
    #: percent of the model's traffic (the weights of a model's routes add up to 100)
    weight: float = 100.0
    #: a canary route is watched and rolled back automatically when it misbehaves;
    #: `true` takes the default bounds, a mapping sets them
    canary: bool | CanaryConfig = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.weight) and self.weight >= 0):
            raise ValueError("weight must be a finite number >= 0")

    @property
    def canary_policy(self) -> CanaryConfig | None:
        """The bounds this route is held to, or None for a baseline route."""
        if isinstance(self.canary, CanaryConfig):
            return self.canary
        return CanaryConfig() if self.canary else None


class ShadowConfig(SpecBase):
    #: the deployment that gets a copy of requests; its answers are compared, never returned
    deployment: str
    #: share of requests copied (0..1)
    fraction: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError("fraction must be in 0..1")


class ModelConfig(SpecBase):
    #: the deployments serving this model and their share of traffic (an A/B split, a canary)
    routes: list[RouteConfig]
    #: what keeps one user on one variant: tenant | key | header:<name> | none
    sticky: str = "tenant"
    #: weighted: every route is its own sticky slice. least_wait: non-canary routes of equal weight
    #: form one pool, and a request that lands in a pool goes to the member with the least expected
    #: wait (stickiness within a pool is given up on purpose: load decides, not the user)
    balance: Literal["weighted", "least_wait"] = "weighted"
    #: mirror a share of requests to another deployment
    shadow: ShadowConfig | None = None
    #: deployments tried in order when the routed one fails or is unavailable
    fallback: list[str] = msgspec.field(default_factory=list)
    #: explicit versions (`/versions/{v}`, `model:v`) -> deployment
    versions: dict[str, str] = msgspec.field(default_factory=dict)
    #: labels (`/labels/{l}`, `model@l`) -> version
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    #: prices in USD of this model's requests (a deployment's own `pricing` wins; docs/pricing.md)
    pricing: Pricing | None = None

    def __post_init__(self) -> None:
        if not self.routes:
            raise ValueError("routes must name at least one deployment")
        if not (self.sticky in ("tenant", "key", "none") or self.sticky.startswith("header:")):
            raise ValueError("sticky must be tenant, key, none or header:<name>")
        names = [r.deployment for r in self.routes]
        if len(set(names)) != len(names):
            raise ValueError("a deployment may appear only once in routes")

    def canaries(self) -> dict[str, CanaryConfig]:
        """Canary routes of this model: deployment -> bounds."""
        return {r.deployment: p for r in self.routes if (p := r.canary_policy) is not None}


class BreakerConfig(SpecBase):
    """Circuit breakers of every deployment (the `breakers:` section)."""

    #: consecutive failures that open a deployment's circuit
    failure_threshold: int = 5
    #: seconds an open circuit waits before one probe request is let through
    cooldown_s: float = 10.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        if not (math.isfinite(self.cooldown_s) and self.cooldown_s > 0):
            raise ValueError("cooldown_s must be a finite number > 0")
