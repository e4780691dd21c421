"""The prices of a call: the worst case reserved at admission, the real cost settled at the end.

A deployment's `pricing` wins over its model's (`models.<name>.pricing`); a LoRA adapter served as a
model is priced by its base deployment. Before a call runs, the deployment that will answer is not
known (a fallback may), so its worst case is taken at the costliest price of its candidates; at the
end it is charged at the price of the deployment that answered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from backends.base import Usage as GenerationUsage
from gateway.core.fleet.deployments import Deployment
from gateway.observe import metrics
from policies.pricing import Pricing, Usage, cost_micros, costliest, usd, worst_case_micros
from router.spec import ModelConfig


class Prices:
    """Prices of the live config (read at each call, so a reload's prices apply at once)."""

    def __init__(
        self, deployments: Mapping[str, Deployment], models: Callable[[], Mapping[str, ModelConfig]]
    ) -> None:
        self._deployments = deployments
        self._models = models

    def of(self, model: str, deployment: str | None) -> Pricing | None:
        """The price of `model` served by `deployment`: the deployment's own, else the model's."""
        dep = self._deployments.get(deployment) if deployment else None
        if dep is not None and dep.spec.pricing is not None:
            return dep.spec.pricing
        spec = self._models().get(model)
        return spec.pricing if spec is not None else None

    def worst(
        self,
        model: str,
        candidates: Iterable[Deployment],
        *,
        input_tokens: int = 0,
        max_output_tokens: int = 0,
        rows: int = 0,
    ) -> int:
        """The most a call may cost in micro-USD on any of `candidates`, reserved at admission."""
        top = costliest([self.of(model, dep.name) for dep in candidates] or [self.of(model, None)])
        return worst_case_micros(top, input_tokens=input_tokens, max_output_tokens=max_output_tokens, rows=rows)

    def graph_worst(self, step_models: Iterable[str], rows: int) -> int:
        """The most a graph request may cost, reserved at admission: every step run on every row, each
        at the costliest deployment its model routes to or falls back on."""
        total = 0
        for model in step_models:
            spec = self._models().get(model)
            names = [*(r.deployment for r in spec.routes), *spec.fallback] if spec is not None else []
            total += self.worst(model, [self._deployments[n] for n in names if n in self._deployments], rows=rows)
        return total

    def charge_steps(self, tenant: str, graph: str, steps: Iterable[tuple[str, str, int]]) -> int:
        """What a graph request cost in micro-USD: each step that ran, as (model, deployment, rows),
        priced as one request to its model on the deployment that served it (rounded per step);
        counted on /metrics under the graph, as its usage row is."""
        micros = sum(cost_micros(self.of(model, dep), Usage(rows=rows)) for model, dep, rows in steps)
        if micros:
            metrics.child(metrics.SPEND, tenant, graph).inc(usd(micros))
        return micros

    def charge_generation(
        self, tenant: str, model: str, deployment: Deployment | None, usage: GenerationUsage, failed: bool
    ) -> int:
        """What a generation cost: its prompt (the part served from a reused prefix at the
        cached-input price) and output tokens, and one request unless it failed."""
        priced = Usage(
            input_tokens=usage.prompt_tokens,
            cached_tokens=min(usage.cached_prompt_tokens, usage.prompt_tokens),
            output_tokens=usage.completion_tokens,
            requests=0 if failed else 1,
        )
        return self.charge(tenant, model, deployment, priced)

    def charge(self, tenant: str, model: str, deployment: Deployment | None, usage: Usage) -> int:
        """What a call cost in micro-USD on the deployment that answered it (counted on /metrics)."""
        micros = cost_micros(self.of(model, deployment.name if deployment else None), usage)
        if micros:
            metrics.child(metrics.SPEND, tenant, model).inc(usd(micros))
        return micros

