"""Model graphs (the `graphs:` section): named steps that each call a model of the same gateway.

A graph is served like a model: clients call it by name, and each step is planned by the router as
a request for its model would be (routes, A/B splits, fallbacks). A step's inputs are mapped from
the request's tensors (`request.<name>`) or from earlier steps' outputs (`<step>.<output>`); the
graph's outputs are named step outputs. A step may be conditional on an earlier step's output
(`when:`), which makes cascades: run the large model only where the small one is unsure.

This module holds the declaration and its structural checks (names, cycles, conditions), and the
order the steps can run in. Tensor checks that need models' signatures are in `router/graph_types.py`;
running a graph is `gateway/core/graphs/runner.py`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal

import msgspec

from backends.spec import SpecBase

#: the prefix of a source that reads a tensor of the caller's request
REQUEST = "request"


class Source(msgspec.Struct, frozen=True):
    """Where a tensor comes from: the request (`step` is None) or an earlier step's output."""

    step: str | None
    tensor: str

    def __str__(self) -> str:
        return f"{self.step or REQUEST}.{self.tensor}"


def parse_source(text: str) -> Source:
    """`request.pixels` or `scale.scaled` -> Source. Raises ValueError for anything else."""
    step, dot, tensor = text.partition(".")
    if not dot or not step or not tensor:
        raise ValueError(f"{text!r} is not `request.<input>` or `<step>.<output>`")
    return Source(None if step == REQUEST else step, tensor)


class StepCondition(SpecBase):
    """Run a step only where an earlier step's output says so (a cascade's escalation).

    Per row of `tensor`, its values are reduced to one number (`reduce`), which must be `below`
    and/or `at_least` the bounds given.
    """

    #: an earlier step's output, `<step>.<output>`
    tensor: str
    #: how a row of `tensor` becomes one number
    reduce: Literal["max", "min", "mean", "sum"] = "max"
    #: the step runs where that number is below this
    below: float | None = None
    #: the step runs where that number is at least this
    at_least: float | None = None
    #: true: the step runs on the rows that qualify only; false: on the whole request when any row does
    per_row: bool = False

    def __post_init__(self) -> None:
        if self.below is None and self.at_least is None:
            raise ValueError("a condition needs `below` or `at_least`")
        for bound in (self.below, self.at_least):
            if bound is not None and not math.isfinite(bound):
                raise ValueError("condition bounds must be finite numbers")

    @property
    def source(self) -> Source:
        return parse_source(self.tensor)


class StepConfig(SpecBase):
    #: the model this step calls (a name of `models:`), routed like any request for it
    model: str
    #: the model's input name -> `request.<input>` or `<step>.<output>`
    inputs: dict[str, str]
    #: run only when this holds (otherwise the step is skipped and counted so)
    when: StepCondition | None = None

    def sources(self) -> dict[str, Source]:
        """The model's input name -> where it comes from."""
        return {name: parse_source(text) for name, text in self.inputs.items()}


class GraphConfig(SpecBase):
    #: step name -> step; steps whose inputs are ready run concurrently
    steps: dict[str, StepConfig]
    #: the graph's output name -> `<step>.<output>`, or a list of them: per row, the first that ran
    #: (a cascade's answer: `[large.probabilities, small.probabilities]`)
    outputs: dict[str, str | list[str]]

    def request_inputs(self) -> set[str]:
        """The request's tensors the steps read (`request.<name>`)."""
        return {src.tensor for step in self.steps.values() for src in step.sources().values() if src.step is None}

    def output_sources(self) -> dict[str, list[Source]]:
        """Graph output name -> its sources in order of preference."""
        return {
            name: [parse_source(t) for t in ([texts] if isinstance(texts, str) else texts)]
            for name, texts in self.outputs.items()
        }


class GraphShape(msgspec.Struct, frozen=True):
    """What the checks found: an order to run in, and what each step waits for."""

    #: steps in an order where every step comes after the steps it reads
    order: tuple[str, ...]
    #: step -> the steps it reads (inputs and condition)
    needs: dict[str, frozenset[str]]
    #: steps that may not run (conditional, or reading a step that may not run)
    optional: frozenset[str]


def _dependencies(name: str, step: StepConfig, steps: Mapping[str, StepConfig], where: str) -> set[str]:
    needs: set[str] = set()
    try:
        sources = step.sources()
    except ValueError as exc:
        raise ValueError(f"{exc} - at `{where}.inputs`") from None
    if not sources:
        raise ValueError(f"a step needs at least one input - at `{where}.inputs`")
    for input_name, source in sources.items():
        if source.step is not None:
            if source.step not in steps:
                raise ValueError(f"unknown step {source.step!r} - at `{where}.inputs.{input_name}`")
            needs.add(source.step)
    if step.when is not None:
        try:
            condition = step.when.source
        except ValueError as exc:
            raise ValueError(f"{exc} - at `{where}.when.tensor`") from None
        if condition.step is None:
            raise ValueError(
                f"a condition reads an earlier step's output, not the request - at `{where}.when.tensor`"
            )
        if condition.step not in steps:
            raise ValueError(f"unknown step {condition.step!r} - at `{where}.when.tensor`")
        needs.add(condition.step)
    if name in needs:
        raise ValueError(f"step {name!r} reads its own output (a cycle: {name} -> {name}) - at `{where}`")
    return needs


def _order(needs: Mapping[str, set[str]], base: str) -> tuple[str, ...]:
    """Steps in dependency order; a cycle is reported with its path."""
    done: list[str] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: placed

    def visit(step: str, path: list[str]) -> None:
        if state.get(step) == 2:
            return
        if state.get(step) == 1:
            cycle = [*path[path.index(step) :], step]
            raise ValueError(f"the steps form a cycle: {' -> '.join(cycle)} - at `{base}.steps.{step}`")
        state[step] = 1
        for dep in sorted(needs[step]):
            visit(dep, [*path, step])
        state[step] = 2
        done.append(step)

    for step in needs:
        visit(step, [])
    return tuple(done)


def check_graph(name: str, graph: GraphConfig, models: Mapping[str, object]) -> GraphShape:
    """Check a graph's structure; raises ValueError naming the path of the first problem.

    Args:
        name: the graph's name (for the path in messages).
        graph: its declaration.
        models: the model names steps may call.
    """
    base = f"$.graphs.{name}"
    if not graph.steps:
        raise ValueError(f"a graph needs at least one step - at `{base}.steps`")
    if not graph.outputs:
        raise ValueError(f"a graph needs at least one output - at `{base}.outputs`")
    needs: dict[str, set[str]] = {}
    for step_name, step in graph.steps.items():
        where = f"{base}.steps.{step_name}"
        if step_name == REQUEST or "." in step_name:
            raise ValueError(f"a step may not be named {REQUEST!r} or contain a dot - at `{where}`")
        if step.model not in models:
            raise ValueError(f"unknown model {step.model!r} - at `{where}.model`")
        needs[step_name] = _dependencies(step_name, step, graph.steps, where)
    order = _order(needs, base)
    optional: set[str] = set()
    for step_name in order:
        step = graph.steps[step_name]
        reads = {s.step for s in step.sources().values() if s.step is not None}
        if step.when is not None or reads & optional:
            optional.add(step_name)
    _check_outputs(graph, base, optional)
    return GraphShape(
        order=order, needs={k: frozenset(v) for k, v in needs.items()}, optional=frozenset(optional)
    )


def _check_outputs(graph: GraphConfig, base: str, optional: set[str]) -> None:
    for output, texts in graph.outputs.items():
        where = f"{base}.outputs.{output}"
        try:
            sources = [parse_source(t) for t in ([texts] if isinstance(texts, str) else texts)]
        except ValueError as exc:
            raise ValueError(f"{exc} - at `{where}`") from None
        if not sources:
            raise ValueError(f"an output needs at least one source - at `{where}`")
        for source in sources:
            if source.step is None:
                raise ValueError(f"an output is a step's output, not a request tensor - at `{where}`")
            if source.step not in graph.steps:
                raise ValueError(f"unknown step {source.step!r} - at `{where}`")
        if sources[-1].step in optional:
            raise ValueError(
                f"step {sources[-1].step!r} may not run (it is conditional or reads a conditional step): "
                f"list a source that always runs last, e.g. `[{sources[-1]}, <step>.<output>]` - at `{where}`"
            )
