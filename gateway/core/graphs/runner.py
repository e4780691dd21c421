"""Running a model graph inside the gateway: each step routed like a request for its model.

The core admits a graph request once (the tenant's limits and quotas are charged for the graph, not
for its steps) and hands it here. Steps start as soon as the tensors they read are in hand, so
independent steps run concurrently on the event loop; each step is planned by the router for its
model (splits, sticky routing, fallbacks), waits its turn in the serving deployment's fair queue as
the calling tenant, and runs there (`GatewayCore.run_tensors`). A step that fails ends the request
with the step named, in the error's own status; its model's fallbacks were tried before that.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import structlog

from backends.base import ModelMetadata, Tensor, TensorRequest, TensorResponse
from backends.errors import BackendUnavailable, InvalidInput
from fleetgate import tracing
from fleetgate.errors import ServingError
from gateway.config import Config
from gateway.core.fleet.deployments import Deployment
from gateway.core.graphs.rows import Rows, Value, common_rows, condition_rows, first_covering, take
from gateway.core.queue.hints import QueueHints
from gateway.observe import metrics
from policies.principal import Principal
from router.graph_types import graph_metadata
from router.graphs import GraphConfig, GraphShape, StepConfig, check_graph
from router.planner import Plan, Router


class GraphPort(Protocol):
    """What a graph run needs of the gateway: the live config and router, deployments' health, a
    visibility check, and the attempt step for one admitted step's tensors (the core provides it;
    the graph was admitted once for all its steps)."""

    @property
    def config(self) -> Config: ...

    @property
    def router(self) -> Router: ...

    @property
    def deployments(self) -> Mapping[str, Deployment]: ...

    def is_healthy(self, deployment: str) -> bool: ...

    def can_see(self, principal: Principal, model: str) -> bool: ...

    async def run_tensors(
        self, principal: Principal, plan: Plan, request: TensorRequest, hints: QueueHints
    ) -> tuple[TensorResponse, Deployment]: ...

log = structlog.get_logger(__name__)


@dataclass
class GraphResult:
    """A graph's answer, and what ran: step -> rows it ran on, -> deployment that served, -> its model."""

    response: TensorResponse
    rows: dict[str, int] = field(default_factory=dict)
    served_by: dict[str, str] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)

    def description(self, graph: str) -> str:
        """The `x-fleetgate-deployment` header of a graph answer: each step that ran, and where."""
        steps = ",".join(f"{step}:{dep}" for step, dep in self.served_by.items())
        return f"graph={graph}; steps={steps}"


@dataclass
class _Run:
    """One graph request in progress."""

    graph_name: str
    graph: GraphConfig
    principal: Principal
    hints: QueueHints
    headers: Mapping[str, str]
    request_id: str
    total_rows: int
    #: `request.<name>` and `<step>.<output>` -> the tensor and the rows it covers
    values: dict[str, Value]
    result: GraphResult


class _Prepared:
    """A graph's structure, checked once per config object: order, needs, outputs each step feeds."""

    def __init__(self, name: str, graph: GraphConfig, models: Mapping[str, object]) -> None:
        self.graph = graph
        self.shape: GraphShape = check_graph(name, graph, models)
        used: dict[str, set[str]] = {step: set() for step in graph.steps}
        sources = [s for step in graph.steps.values() for s in step.sources().values()]
        sources += [step.when.source for step in graph.steps.values() if step.when is not None]
        sources += [s for alternatives in graph.output_sources().values() for s in alternatives]
        for source in sources:
            if source.step is not None:
                used[source.step].add(source.tensor)
        #: step -> the outputs other steps or the graph read (the only ones asked of its model)
        self.used = {step: sorted(names) for step, names in used.items()}


class GraphRunner:
    """Runs the graphs of one gateway (`core.config.graphs`) through a narrow port."""

    def __init__(self, core: GraphPort) -> None:
        self.core = core
        self._prepared: dict[str, _Prepared] = {}

    def _prepare(self, name: str) -> _Prepared:
        graph = self.core.config.graphs[name]
        prepared = self._prepared.get(name)
        if prepared is None or prepared.graph is not graph:  # first use, or a reload replaced it
            prepared = self._prepared[name] = _Prepared(name, graph, self.core.config.models)
        return prepared

    # --- what a graph looks like from outside ----------------------------------------------

    def _loaded_signature(self, graph: str, step: str, model: str) -> ModelMetadata:
        spec = self.core.router.get(model)
        for name in [*(r.deployment for r in spec.routes), *spec.fallback]:
            dep = self.core.deployments.get(name)
            if dep is not None and dep.ready:
                return dep.backend.metadata()
        log.warning("graph_step_not_loaded", graph=graph, step=step, model=model)
        raise BackendUnavailable(f"graph {graph!r}: step {step!r} has no loaded deployment")

    def metadata(self, name: str) -> ModelMetadata:
        """The graph as a model: inputs and outputs derived from its steps' loaded models."""
        graph = self._prepare(name).graph
        models = {step.model: step_name for step_name, step in reversed(graph.steps.items())}
        signatures = {model: self._loaded_signature(name, step, model) for model, step in models.items()}
        return graph_metadata(name, graph, signatures.__getitem__)

    def ready(self, name: str) -> bool:
        """Whether every step's model has a deployment that can take a request now."""
        graph = self.core.config.graphs[name]
        for step in graph.steps.values():
            spec = self.core.router.get(step.model)
            names = [r.deployment for r in spec.routes] + list(spec.fallback)
            if not any(self.core.is_healthy(d) for d in names):
                return False
        return True

    # --- running ---------------------------------------------------------------------------

    async def run(
        self,
        principal: Principal,
        name: str,
        request: TensorRequest,
        hints: QueueHints,
        headers: Mapping[str, str],
    ) -> GraphResult:
        """Run the graph on a request already checked against `metadata(name)` and admitted."""
        if name not in self.core.config.graphs:  # a reload removed it while the body was read
            raise BackendUnavailable(f"graph {name!r} was removed by a config reload")
        prepared = self._prepare(name)
        given = {t.name for t in request.inputs}
        for source in prepared.graph.request_inputs():
            if source not in given:  # a reload changed the graph while the body was read
                raise InvalidInput(f"graph {name!r} takes input {source!r} (its config changed); send it")
        run = _Run(
            graph_name=name,
            graph=prepared.graph,
            principal=principal,
            hints=hints,
            headers=headers,
            request_id=request.id,
            total_rows=request.batch_rows,
            values={f"request.{t.name}": Value(np.asarray(t.data)) for t in request.inputs},
            result=GraphResult(TensorResponse(id=request.id, outputs=[])),
        )
        await self._run_steps(run, prepared)
        run.result.response.outputs = self._outputs(run, request.outputs)
        return run.result

    async def _run_steps(self, run: _Run, prepared: _Prepared) -> None:
        """Start each step once the steps it reads are done; the first failure ends the others."""
        waiting = dict(prepared.shape.needs)
        done: set[str] = set()
        running: dict[asyncio.Future[None], str] = {}
        try:
            while waiting or running:
                for step in [s for s, needs in waiting.items() if needs <= done]:
                    del waiting[step]
                    work = self._step(run, step, run.graph.steps[step], prepared.used[step])
                    running[asyncio.ensure_future(work)] = step
                finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in finished:
                    done.add(running.pop(task))
                    task.result()  # the step's error, already naming it
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)

    def _step_rows(self, run: _Run, step: StepConfig, sources: list[Value | None]) -> Rows | bool:
        """The rows the step runs on (None: all), or False when it is skipped."""
        if any(v is None for v in sources):
            return False  # it reads a step that was skipped
        rows = common_rows([v for v in sources if v is not None])
        if step.when is not None:
            tested = run.values.get(step.when.tensor)
            held = False if tested is None else condition_rows(step.when, tested)
            if held is False:
                return False
            if held is not True and held is not None:
                rows = held if rows is None else np.intersect1d(rows, held, assume_unique=True)
        if rows is not None and len(rows) == 0:
            return False
        return rows

    async def _step(self, run: _Run, step_name: str, step: StepConfig, outputs: list[str]) -> None:
        sources = step.sources()
        rows = self._step_rows(run, step, [run.values.get(str(s)) for s in sources.values()])
        labels = (run.graph_name, step_name)
        if rows is False:
            metrics.GRAPH_STEPS.labels(*labels, "skipped").inc()
            metrics.GRAPH_STEP_ROWS.labels(*labels, "skipped").inc(run.total_rows)
            return
        assert rows is not True
        try:
            inputs = [
                Tensor.from_array(input_name, take(run.values[str(source)], rows, f"input {input_name!r}"))
                for input_name, source in sources.items()
            ]
            request = TensorRequest(id=f"{run.request_id}.{step_name}", inputs=inputs, outputs=outputs)
            plan = self.core.router.plan(step.model, principal=run.principal, headers=run.headers)
            with tracing.child("graph.step", **{"fleetgate.step": step_name, "fleetgate.model": step.model}):
                response, dep = await self.core.run_tensors(run.principal, plan, request, run.hints)
        except ServingError as exc:
            metrics.GRAPH_STEPS.labels(*labels, "failed").inc()
            log.warning("graph_step_failed", graph=run.graph_name, step=step_name, model=step.model, error=str(exc))
            visible = self.core.can_see(run.principal, step.model)
            raise _naming_step(exc, run.graph_name, step_name, step.model if visible else None) from exc
        ran = run.total_rows if rows is None else len(rows)
        metrics.GRAPH_STEPS.labels(*labels, "ran").inc()
        metrics.GRAPH_STEP_ROWS.labels(*labels, "ran").inc(ran)
        if ran < run.total_rows:
            metrics.GRAPH_STEP_ROWS.labels(*labels, "skipped").inc(run.total_rows - ran)
        run.result.rows[step_name] = ran
        run.result.served_by[step_name] = dep.name
        run.result.models[step_name] = step.model
        for tensor in response.outputs:
            run.values[f"{step_name}.{tensor.name}"] = Value(np.asarray(tensor.data), rows)

    def _outputs(self, run: _Run, wanted: list[str] | None) -> list[Tensor]:
        out = []
        for name, sources in run.graph.output_sources().items():
            if wanted is not None and name not in wanted:
                continue
            ran = [v for s in sources if (v := run.values.get(str(s))) is not None]
            if not ran:
                raise BackendUnavailable(f"graph {run.graph_name!r}: no source of output {name!r} ran")
            array = ran[0].array if len(ran) == 1 and ran[0].rows is None else first_covering(name, ran)
            out.append(Tensor.from_array(name, array))
        return out


def _naming_step(exc: ServingError, graph: str, step: str, model: str | None) -> ServingError:
    """The same error (status, code, headers), its message naming the graph's step. For a step
    model the caller may not see (`model` None) only its code is told: its own message may name
    the model or its deployments, which must stay as invisible as the model (the log has it)."""
    named = copy.copy(exc)
    if model is None:
        named.message = f"graph {graph!r} step {step!r} failed: {exc.code.replace('_', ' ')}"
    else:
        named.message = f"graph {graph!r} step {step!r} (model {model!r}): {exc.message}"
    named.args = (named.message,)
    return named
