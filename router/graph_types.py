"""A graph's tensors against its models' signatures: config checks and the graph's own metadata.

Both take the signatures as a lookup (model name -> ModelMetadata, or None where unknown): at config
time they are read from the model files (`backends/runtime/signatures.py`), at run time they are the loaded
deployments' metadata. Unknown signatures (a remote upstream before start-up) are skipped by the
checks; the runtimes still refuse a mistyped tensor per request, naming the step.
"""

from __future__ import annotations

from collections.abc import Callable

from backends.base import ModelMetadata, TensorSpec
from router.graphs import GraphConfig, Source, StepConfig

#: Triton's platform name for a model made of other models
PLATFORM = "ensemble"

Signatures = Callable[[str], ModelMetadata | None]


def _fmt(spec: TensorSpec) -> str:
    return f"{spec.datatype} [{', '.join(str(d) for d in spec.shape)}]"


def shapes_compatible(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Same rank, and each dimension equal or dynamic (-1) on either side."""
    return len(a) == len(b) and all(x == y or -1 in (x, y) for x, y in zip(a, b, strict=True))


def _merge_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(x if x == y else -1 for x, y in zip(a, b, strict=True))


def _produced(graph: GraphConfig, source: Source, signatures: Signatures, where: str) -> TensorSpec | None:
    """The spec of a step's output, or None where its model's signature is unknown."""
    assert source.step is not None
    model = graph.steps[source.step].model
    meta = signatures(model)
    if meta is None:
        return None
    for spec in meta.outputs:
        if spec.name == source.tensor:
            return spec
    names = sorted(s.name for s in meta.outputs)
    raise ValueError(
        f"step {source.step!r} (model {model!r}) has no output {source.tensor!r}; its outputs are {names} - at `{where}`"
    )


def _check_step_inputs(
    base: str,
    step_name: str,
    step: StepConfig,
    graph: GraphConfig,
    signatures: Signatures,
    request_specs: dict[str, tuple[TensorSpec, str]],
) -> None:
    where = f"{base}.steps.{step_name}.inputs"
    meta = signatures(step.model)
    wanted = {s.name: s for s in meta.inputs} if meta is not None else None
    if wanted is not None:
        for input_name in step.inputs:
            if input_name not in wanted:
                raise ValueError(
                    f"model {step.model!r} has no input {input_name!r}; its inputs are {sorted(wanted)} "
                    f"- at `{where}.{input_name}`"
                )
        unmapped = sorted(set(wanted) - set(step.inputs))
        if unmapped:
            raise ValueError(f"input(s) {unmapped} of model {step.model!r} are not mapped - at `{where}`")
    for input_name, source in step.sources().items():
        path = f"{where}.{input_name}"
        target = wanted.get(input_name) if wanted is not None else None
        if source.step is None:
            if target is not None:
                _same_request_tensor(source.tensor, target, path, request_specs)
            continue
        given = _produced(graph, source, signatures, path)
        if given is None or target is None:
            continue
        if given.datatype != target.datatype or not shapes_compatible(given.shape, target.shape):
            raise ValueError(
                f"mistyped tensor: {source} is {_fmt(given)}, input {input_name!r} of model {step.model!r} "
                f"takes {_fmt(target)} - at `{path}`"
            )


def _same_request_tensor(
    name: str, target: TensorSpec, path: str, seen: dict[str, tuple[TensorSpec, str]]
) -> None:
    """A request tensor fed to several steps must suit each of them."""
    if name not in seen:
        seen[name] = (target, path)
        return
    first, first_path = seen[name]
    if first.datatype != target.datatype or not shapes_compatible(first.shape, target.shape):
        raise ValueError(
            f"mistyped tensor: request.{name} feeds {_fmt(first)} at `{first_path}` and {_fmt(target)} - at `{path}`"
        )


def check_graph_tensors(name: str, graph: GraphConfig, signatures: Signatures) -> None:
    """Check every mapped tensor whose signatures are known; raises ValueError naming the path."""
    base = f"$.graphs.{name}"
    request_specs: dict[str, tuple[TensorSpec, str]] = {}
    for step_name, step in graph.steps.items():
        _check_step_inputs(base, step_name, step, graph, signatures, request_specs)
        if step.when is not None:
            path = f"{base}.steps.{step_name}.when.tensor"
            spec = _produced(graph, step.when.source, signatures, path)
            if spec is not None and spec.datatype == "BYTES":
                raise ValueError(
                    f"a condition needs a numeric tensor; {step.when.tensor} is BYTES - at `{path}`"
                )
    for output, sources in graph.output_sources().items():
        path = f"{base}.outputs.{output}"
        specs = [(s, spec) for s in sources if (spec := _produced(graph, s, signatures, path)) is not None]
        for (s, spec), (first_source, first) in zip(specs[1:], specs, strict=False):
            if spec.datatype != first.datatype or len(spec.shape) != len(first.shape):
                raise ValueError(
                    f"mistyped tensor: the sources of an output differ, {first_source} is {_fmt(first)} "
                    f"and {s} is {_fmt(spec)} - at `{path}`"
                )


def graph_metadata(
    name: str, graph: GraphConfig, signatures: Callable[[str], ModelMetadata]
) -> ModelMetadata:
    """The graph as a model: its inputs are the request tensors its steps read (typed as the first
    step reading each takes it), its outputs the step outputs it names."""
    inputs: dict[str, TensorSpec] = {}
    for step in graph.steps.values():
        wanted = {s.name: s for s in signatures(step.model).inputs}
        for input_name, source in step.sources().items():
            spec = wanted.get(input_name)
            if source.step is None and source.tensor not in inputs and spec is not None:
                inputs[source.tensor] = TensorSpec(
                    name=source.tensor, datatype=spec.datatype, shape=spec.shape
                )
    outputs: list[TensorSpec] = []
    for output, sources in graph.output_sources().items():
        merged: TensorSpec | None = None
        for source in sources:
            assert source.step is not None
            produced = {s.name: s for s in signatures(graph.steps[source.step].model).outputs}
            spec = produced.get(source.tensor)
            if spec is None:
                continue
            if merged is None:
                merged = TensorSpec(name=output, datatype=spec.datatype, shape=spec.shape)
            elif len(merged.shape) == len(spec.shape):
                merged = TensorSpec(
                    name=output, datatype=merged.datatype, shape=_merge_shape(merged.shape, spec.shape)
                )
        if merged is not None:
            outputs.append(merged)
    return ModelMetadata(name=name, platform=PLATFORM, inputs=list(inputs.values()), outputs=outputs)
