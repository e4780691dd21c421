"""The operations interface: the one way admin, console, reload and adapter management change a
running core. Nothing else assigns the core's fields; readers (views, probes) read them freely.
"""

from __future__ import annotations

import structlog

from gateway.config import Config, ConfigError
from gateway.core.calls import register_metric_models
from gateway.core.service import GatewayCore

log = structlog.get_logger("gateway.core")


class Operations:
    """Changes to a live `GatewayCore`: config swaps, LoRA adapters, canary restores."""

    def __init__(self, core: GatewayCore) -> None:
        self._core = core

    def apply_config(self, new: Config) -> None:
        """Swap the live config of a running gateway. Raises ConfigError when it cannot be applied
        (nothing changes then: a refused reload leaves the running config whole)."""
        core = self._core
        changes = _deployment_changes(core.config, new)
        if changes:
            raise ConfigError(f"deployment changes need a restart ({'; '.join(changes)}) - at `$.deployments`")
        if new.server != core.config.server or new.state != core.config.state:
            raise ConfigError("server and state changes need a restart - at `$.server` / `$.state`")
        if new.auth != core.config.auth:
            raise ConfigError("auth changes need a restart - at `$.auth`")
        if new.storage != core.config.storage:
            # the model cache and offline mode are read when deployments load: applied now, they would
            # silently do nothing until the next restart
            raise ConfigError("storage changes need a restart - at `$.storage`")
        if new.budget_alerts != core.config.budget_alerts:
            # thresholds and the webhook are wired into the alert sink at start
            raise ConfigError("budget_alerts changes need a restart - at `$.budget_alerts`")
        taken = sorted((set(new.models) | set(new.graphs)) & set(core.adapter_models))
        if taken:
            raise ConfigError(f"model names {taken} are served LoRA adapters; unload them first - at `$.models`")
        weights = {name: t.weight for name, t in new.tenants.items()}
        core.identity.update_tenants(list(new.tenants))
        core.admission.update_tenants(new.tenants)
        for dep in core.deployments.values():
            dep.queue.update_weights(weights)
        core.router.update(core.served_models(new))
        register_metric_models([*new.models, *new.graphs])
        core.breakers.failure_threshold = new.breakers.failure_threshold
        core.breakers.cooldown_s = new.breakers.cooldown_s
        core.config = new
        log.info("config_reloaded", models=len(new.models), tenants=len(new.tenants))

    def serve_adapter(self, name: str, deployment: str) -> None:
        """Route model `name` to a LoRA adapter that `deployment`'s backend has loaded."""
        self._core.adapter_models[name] = deployment
        register_metric_models([name])
        self._core.router.update(self._core.served_models())

    def stop_serving_adapter(self, name: str) -> None:
        """Stop routing to adapter `name` (before its backend unloads it: no new request lands on it)."""
        del self._core.adapter_models[name]
        self._core.router.update(self._core.served_models())

    def restore_canary(self, model: str, deployment: str) -> tuple[bool, float]:
        """Give a rolled-back canary its configured weight back: (was rolled back, weight now).

        Raises:
            KeyError: `deployment` is not a canary route of `model`.
        """
        was_rolled_back = self._core.router.canaries.restore(model, deployment)
        return was_rolled_back, self._core.router.effective_weights(model)[deployment]


def _deployment_changes(old: Config, new: Config) -> list[str]:
    added = sorted(set(new.deployments) - set(old.deployments))
    removed = sorted(set(old.deployments) - set(new.deployments))
    changed = sorted(
        n for n in set(old.deployments) & set(new.deployments) if old.deployments[n] != new.deployments[n]
    )
    return [
        f"{what} {names}"
        for what, names in (("added", added), ("removed", removed), ("changed", changed))
        if names
    ]
