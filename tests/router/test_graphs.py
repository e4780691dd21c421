"""Model graphs refused at config time, one test per kind of mistake, each one clear line naming
its path; and the row logic of cascades (which rows a step covers, how outputs are joined)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from gateway.config import ConfigError, parse_config
from gateway.core.graphs.rows import (
    GraphMisconfigured,
    Value,
    common_rows,
    condition_rows,
    first_covering,
    take,
)
from router.graphs import StepCondition, check_graph
from tests.graph_models import GraphModels, ensemble_steps, step_sections, write_graph_models


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> GraphModels:
    return write_graph_models(tmp_path_factory.mktemp("graph-models"))


def _config(
    models: GraphModels, graphs: dict, deployments: dict | None = None, served: dict | None = None
) -> str:
    """The step models (tests/graph_models.py), a remote upstream `far`, and `deployments` / `served` more."""
    more_deployments, more_served = deployments or {}, served or {}
    deployments, served = step_sections(models)
    deployments["remote"] = {"backend": "remote", "url": "http://127.0.0.1:9", "protocol": "kserve_v2"}
    served["far"] = {"routes": [{"deployment": "remote"}]}
    deployments.update(more_deployments)
    served.update(more_served)
    config = {"state": {"url": "memory://"}, "deployments": deployments, "models": served, "graphs": graphs}
    return yaml.safe_dump(config, sort_keys=False)


def _ensemble(**changes: dict) -> dict:
    steps = ensemble_steps()
    steps.update(changes)
    return {"ens": {"steps": steps, "outputs": {"probabilities": "mean.mean"}}}


def _refused(models: GraphModels, graphs: dict) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(_config(models, graphs), base_dir=Path("."))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_good_graph_passes(models: GraphModels) -> None:
    config = parse_config(_config(models, _ensemble()), base_dir=Path("."))
    shape = check_graph("ens", config.graphs["ens"], config.models)
    assert shape.order[0] == "pre" and shape.order[-1] == "mean"
    assert shape.needs["mean"] == {"a", "b"} and shape.needs["a"] == {"pre"} and not shape.optional


def test_cycle(models: GraphModels) -> None:
    message = _refused(
        models,
        _ensemble(
            pre={"model": "scale", "inputs": {"raw": "mean.mean"}},
        ),
    )
    assert "cycle: " in message and "pre -> " in message and message.endswith("`$.graphs.ens.steps.pre`")


def test_a_step_reading_itself_is_a_cycle(models: GraphModels) -> None:
    message = _refused(models, _ensemble(a={"model": "mlp-a", "inputs": {"x": "a.probs"}}))
    assert "a cycle: a -> a" in message


def test_unknown_model(models: GraphModels) -> None:
    message = _refused(models, _ensemble(b={"model": "mlp-c", "inputs": {"x": "pre.scaled"}}))
    assert message == "unknown model 'mlp-c' - at `$.graphs.ens.steps.b.model`"


def test_unknown_step(models: GraphModels) -> None:
    message = _refused(models, _ensemble(b={"model": "mlp-b", "inputs": {"x": "prep.scaled"}}))
    assert message == "unknown step 'prep' - at `$.graphs.ens.steps.b.inputs.x`"


def test_bad_source_syntax(models: GraphModels) -> None:
    message = _refused(models, _ensemble(b={"model": "mlp-b", "inputs": {"x": "scaled"}}))
    assert "is not `request.<input>` or `<step>.<output>`" in message
    assert message.endswith("`$.graphs.ens.steps.b.inputs`")


def test_unmapped_input(models: GraphModels) -> None:
    message = _refused(models, _ensemble(mean={"model": "average", "inputs": {"a": "a.probs"}}))
    assert message == "input(s) ['b'] of model 'average' are not mapped - at `$.graphs.ens.steps.mean.inputs`"


def test_input_the_model_does_not_have(models: GraphModels) -> None:
    message = _refused(models, _ensemble(b={"model": "mlp-b", "inputs": {"input": "pre.scaled"}}))
    assert "model 'mlp-b' has no input 'input'; its inputs are ['x']" in message


def test_unknown_output_of_a_step(models: GraphModels) -> None:
    message = _refused(
        models, _ensemble(mean={"model": "average", "inputs": {"a": "a.probs", "b": "b.logits"}})
    )
    assert message == (
        "step 'b' (model 'mlp-b') has no output 'logits'; its outputs are ['probs'] "
        "- at `$.graphs.ens.steps.mean.inputs.b`"
    )


def test_mistyped_shape(models: GraphModels) -> None:
    # probabilities [-1, 10] into an input of [-1, 64]
    message = _refused(models, _ensemble(b={"model": "mlp-b", "inputs": {"x": "a.probs"}}))
    assert message == (
        "mistyped tensor: a.probs is FP32 [-1, 10], input 'x' of model 'mlp-b' takes FP32 [-1, 64] "
        "- at `$.graphs.ens.steps.b.inputs.x`"
    )


def test_mistyped_datatype(models: GraphModels) -> None:
    graphs = _ensemble(ids={"model": "ids", "inputs": {"ids": "mean.mean"}})
    message = _refused(models, graphs)
    assert (
        "mistyped tensor: mean.mean is FP32 [-1, 10], input 'ids' of model 'ids' takes INT64 [-1]" in message
    )


def test_request_tensor_feeding_two_types(models: GraphModels) -> None:
    graphs = _ensemble(ids={"model": "ids", "inputs": {"ids": "request.pixels"}})
    message = _refused(models, graphs)
    assert message.startswith("mistyped tensor: request.pixels feeds FP32 [-1, 64]")


def test_unknown_signature_is_checked_at_run_time_only(models: GraphModels) -> None:
    # a remote upstream's tensors are known once it answers: the mapping itself is still checked
    graphs = _ensemble(far={"model": "far", "inputs": {"anything": "mean.mean"}})
    parse_config(_config(models, graphs), base_dir=Path("."))
    graphs = _ensemble(far={"model": "far", "inputs": {"anything": "nowhere.mean"}})
    assert "unknown step 'nowhere'" in _refused(models, graphs)


def test_output_of_a_conditional_step_needs_a_source_that_always_runs(models: GraphModels) -> None:
    cascade = {
        "c": {
            "steps": {
                "small": {"model": "mlp-a", "inputs": {"x": "request.x"}},
                "large": {
                    "model": "mlp-b",
                    "inputs": {"x": "request.x"},
                    "when": {"tensor": "small.probs", "below": 0.5},
                },
            },
            "outputs": {"probabilities": "large.probs"},
        }
    }
    message = _refused(models, cascade)
    assert "step 'large' may not run" in message and message.endswith("`$.graphs.c.outputs.probabilities`")
    cascade["c"]["outputs"]["probabilities"] = ["large.probs", "small.probs"]
    parse_config(_config(models, cascade), base_dir=Path("."))


def test_condition_on_the_request_or_without_bounds(models: GraphModels) -> None:
    graphs = _ensemble(
        b={"model": "mlp-b", "inputs": {"x": "pre.scaled"}, "when": {"tensor": "request.pixels", "below": 1}}
    )
    assert "a condition reads an earlier step's output" in _refused(models, graphs)
    graphs = _ensemble(b={"model": "mlp-b", "inputs": {"x": "pre.scaled"}, "when": {"tensor": "a.probs"}})
    message = _refused(models, graphs)
    assert "a condition needs `below` or `at_least`" in message and "$.graphs.ens" in message


def test_step_calling_a_text_generation_model(models: GraphModels, tmp_path: Path) -> None:
    graphs = _ensemble(b={"model": "chat", "inputs": {"x": "pre.scaled"}})
    llm = {"llm": {"backend": "torch_llm", "model": str(tmp_path)}}
    text = _config(models, graphs, llm, {"chat": {"routes": [{"deployment": "llm"}]}})
    with pytest.raises(ConfigError) as err:
        parse_config(text, base_dir=Path("."))
    assert str(err.value) == (
        "model 'chat' generates text; a graph step calls a tensor model - at `$.graphs.ens.steps.b.model`"
    )


def test_graph_named_like_a_model(models: GraphModels) -> None:
    graphs = {"scale": _ensemble()["ens"]}
    assert (
        _refused(models, graphs)
        == "graph 'scale' is also a model name; pick another name - at `$.graphs.scale`"
    )


def test_unknown_field_names_the_graph(models: GraphModels) -> None:
    graphs = _ensemble(a={"model": "mlp-a", "inputs": {"x": "pre.scaled"}, "fallbacks": ["x"]})
    message = _refused(models, graphs)
    assert "fallbacks" in message and "$.graphs.ens.steps" in message


def test_check_config_cli_prints_one_line(models: GraphModels, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(_config(models, _ensemble(b={"model": "mlp-b", "inputs": {"x": "a.probs"}})))
    done = subprocess.run(
        [sys.executable, "-m", "gateway.serve.cli", "check-config", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "mistyped tensor: a.probs" in lines[0], done.stderr
    good = tmp_path / "good.yaml"
    good.write_text(_config(models, _ensemble()))
    done = subprocess.run(
        [sys.executable, "-m", "gateway.serve.cli", "check-config", str(good)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "1 graphs" in done.stdout, done.stderr


# --- rows of a cascade ---------------------------------------------------------------------------


def test_condition_rows_per_row_and_whole_request() -> None:
    probs = np.array([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8], [0.55, 0.45]], dtype=np.float32)
    per_row = StepCondition(tensor="s.p", below=0.7, per_row=True)
    assert condition_rows(per_row, Value(probs)).tolist() == [1, 3]
    # a tensor that covers rows 1..3 only answers in the request's row numbers
    assert condition_rows(per_row, Value(probs[1:], np.array([1, 2, 3]))).tolist() == [1, 3]
    assert condition_rows(StepCondition(tensor="s.p", below=0.95, per_row=True), Value(probs)) is None
    assert condition_rows(StepCondition(tensor="s.p", below=0.7), Value(probs)) is True
    assert condition_rows(StepCondition(tensor="s.p", at_least=0.95), Value(probs)) is False
    mean = StepCondition(tensor="s.p", reduce="min", at_least=0.4, per_row=True)
    assert condition_rows(mean, Value(probs)).tolist() == [1, 3]


def test_rows_taken_and_outputs_joined_row_by_row() -> None:
    full = Value(np.arange(8).reshape(4, 2))
    some = Value(np.array([[10, 11], [30, 31]]), np.array([1, 3]))
    assert common_rows([full, some]).tolist() == [1, 3]
    assert take(full, np.array([1, 3]), "x").tolist() == [[2, 3], [6, 7]]
    assert take(some, np.array([3]), "x").tolist() == [[30, 31]]
    joined = first_covering("p", [some, full])
    assert joined.tolist() == [[0, 1], [10, 11], [4, 5], [30, 31]]
    assert full.array[1].tolist() == [2, 3]  # the source itself is left alone
    with pytest.raises(GraphMisconfigured, match="no source covers every row"):
        first_covering("p", [full, some])
    with pytest.raises(GraphMisconfigured, match="cuts tensors along dimension 0"):
        take(Value(np.arange(2)), np.array([0, 3]), "input 'x'")
