"""Shadow traffic: mirror a request to a shadow deployment after the caller has its answer.

The shadow runs as a background task started once the primary's answer is in hand; nothing the
caller awaits ever waits on it, no admission or quota is charged for it, and every error it raises
is caught here. Its answer is compared with the primary's (`router.compare`) in a worker thread and
exported per (model, primary, shadow). At most `max_in_flight` shadows run at once per gateway; a
request beyond that is not mirrored (counted as outcome="dropped"), so a slow shadow cannot pile up
unbounded work.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import msgspec
import structlog

from backends.base import Capability, GenerateRequest, TensorRequest, TensorResponse
from gateway.core.fleet.deployments import Deployment
from gateway.observe import metrics
from router.compare import compare_tensors, compare_text
from router.planner import Plan

log = structlog.get_logger(__name__)


class Shadows:
    """Starts, bounds and compares shadow requests.

    Args:
        deployments: every deployment by name.
        max_in_flight: shadow requests allowed at once.
    """

    def __init__(
        self, deployments: Mapping[str, Deployment], max_in_flight: int = 64, timeout_s: float = 30.0
    ) -> None:
        self._deployments = deployments
        self.max_in_flight = max_in_flight
        #: a shadow still running after this is cancelled (counted as an error): a hung shadow
        #: deployment cannot pin every shadow slot
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[Any]] = set()

    def _targets(self, plan: Plan, served: Deployment, capability: Capability) -> list[Deployment]:
        out = []
        for name in plan.shadows:
            dep = self._deployments.get(name)
            if dep is None or dep is served or not dep.ready or capability not in dep.backend.capabilities:
                continue
            if len(self._tasks) >= self.max_in_flight:
                metrics.SHADOW_REQUESTS.labels(plan.model, served.name, name, "dropped").inc()
                continue
            out.append(dep)
        return out

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def mirror_tensor(
        self, plan: Plan, served: Deployment, request: TensorRequest, answer: TensorResponse
    ) -> None:
        """Mirror a tensor request whose primary answer is `answer` (returns at once)."""
        for dep in self._targets(plan, served, Capability.TENSOR):
            self._spawn(self._run_tensor(plan.model, served.name, dep, request, answer))

    def mirror_text(
        self, plan: Plan, served: Deployment, request: GenerateRequest, text: str, token_ids: list[int]
    ) -> None:
        """Mirror a finished generation whose primary completion is `text` (returns at once)."""
        for dep in self._targets(plan, served, Capability.GENERATE):
            copy = msgspec.structs.replace(request, request_id=f"{request.request_id}-shadow-{dep.name}")
            self._spawn(self._run_text(plan.model, served.name, dep, copy, text, token_ids))

    async def _run_tensor(
        self, model: str, primary: str, dep: Deployment, request: TensorRequest, answer: TensorResponse
    ) -> None:
        labels = (model, primary, dep.name)
        try:
            async with asyncio.timeout(self.timeout_s):
                theirs = await dep.backend.infer(request)
            diff = await asyncio.to_thread(compare_tensors, answer.outputs, theirs.outputs)
        except Exception as exc:  # noqa: BLE001 - a shadow never affects anyone
            metrics.SHADOW_REQUESTS.labels(*labels, "error").inc()
            log.info("shadow_failed", model=model, primary=primary, shadow=dep.name, error=str(exc))
            return
        metrics.SHADOW_REQUESTS.labels(*labels, "ok").inc()
        if diff.mismatch:
            metrics.SHADOW_SHAPE_MISMATCH.labels(*labels).inc()
            return
        metrics.SHADOW_COMPARED.labels(*labels).inc()
        metrics.SHADOW_MAX_ABS_DIFF.labels(*labels).observe(diff.max_abs)
        metrics.SHADOW_MAX_REL_DIFF.labels(*labels).observe(diff.max_rel)

    async def _run_text(
        self,
        model: str,
        primary: str,
        dep: Deployment,
        request: GenerateRequest,
        text: str,
        token_ids: list[int],
    ) -> None:
        labels = (model, primary, dep.name)
        parts: list[str] = []
        ids: list[int] = []
        try:
            async with asyncio.timeout(self.timeout_s):
                async for event in dep.backend.generate(request):
                    parts.append(event.text)
                    ids.extend(event.token_ids)
                    if event.finish_reason == "error":
                        raise RuntimeError("the shadow's stream ended with an error")
        except Exception as exc:  # noqa: BLE001 - a shadow never affects anyone (TimeoutError too)
            metrics.SHADOW_REQUESTS.labels(*labels, "error").inc()
            log.info("shadow_failed", model=model, primary=primary, shadow=dep.name, error=str(exc))
            return
        metrics.SHADOW_REQUESTS.labels(*labels, "ok").inc()
        diff = compare_text(text, "".join(parts), token_ids, ids)
        metrics.SHADOW_COMPARED.labels(*labels).inc()
        exact = metrics.SHADOW_EXACT_MATCH.labels(*labels)  # the series exists, at 0, from the first pair
        if diff.exact:
            exact.inc()
        metrics.SHADOW_TOKEN_AGREEMENT.labels(*labels, diff.unit).observe(diff.agreement)

    async def close(self, timeout_s: float = 5.0) -> None:
        """At shutdown: let the shadows in flight finish for up to `timeout_s`, then cancel them."""
        if not self._tasks:
            return
        _, pending = await asyncio.wait(list(self._tasks), timeout=timeout_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
