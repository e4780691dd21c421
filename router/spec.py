"""The `models:` section of the config: what clients ask for and which deployments serve it."""

from __future__ import annotations

import msgspec

from backends.spec import SpecBase


class RouteConfig(SpecBase):
    deployment: str
    weight: float = 100.0
    #: a canary route is watched and rolled back automatically when it misbehaves
    canary: bool = False

    def __post_init__(self) -> None:
        if self.weight < 0:
            raise ValueError("weight must be >= 0")


class ShadowConfig(SpecBase):
    deployment: str
    fraction: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError("fraction must be in 0..1")


class ModelConfig(SpecBase):
    routes: list[RouteConfig]
    #: what keeps one user on one variant: tenant | key | header:<name> | none
    sticky: str = "tenant"
    shadow: ShadowConfig | None = None
    fallback: list[str] = msgspec.field(default_factory=list)
    #: explicit versions (`/versions/{v}`, `model:v`) -> deployment
    versions: dict[str, str] = msgspec.field(default_factory=dict)
    #: labels (`/labels/{l}`, `model@l`) -> version
    labels: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.routes:
            raise ValueError("routes must name at least one deployment")
        if not (self.sticky in ("tenant", "key", "none") or self.sticky.startswith("header:")):
            raise ValueError("sticky must be tenant, key, none or header:<name>")
