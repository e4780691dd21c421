"""Circuit breakers with an injected clock."""

from __future__ import annotations

import pytest

from backends.errors import BackendTimeout, InvalidInput, ModelNotFound
from router.health import CLOSED, HALF_OPEN, OPEN, CircuitBreakers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_and_probes_after_cooldown():
    clock = Clock()
    b = CircuitBreakers(failure_threshold=3, cooldown_s=10, clock=clock)
    assert not b.on_failure("d") and not b.on_failure("d")
    assert b.allows("d")
    assert b.on_failure("d") is True
    assert b.state("d") == OPEN and not b.allows("d")
    clock.now += 9.9
    assert not b.allows("d")
    clock.now += 0.2
    assert b.state("d") == HALF_OPEN and b.allows("d")
    b.on_attempt("d")
    assert not b.allows("d"), "one probe at a time"
    b.on_success("d")
    assert b.state("d") == CLOSED and b.allows("d")


def test_failed_probe_reopens_for_another_cooldown():
    clock = Clock()
    b = CircuitBreakers(failure_threshold=1, cooldown_s=5, clock=clock)
    b.on_failure("d")
    clock.now += 5
    b.on_attempt("d")
    assert b.on_failure("d") is True
    assert b.state("d") == OPEN
    clock.now += 4
    assert not b.allows("d")


def test_success_resets_the_failure_count():
    b = CircuitBreakers(failure_threshold=2, cooldown_s=5, clock=Clock())
    b.on_failure("d")
    b.on_success("d")
    b.on_failure("d")
    assert b.state("d") == CLOSED


def test_no_answer_frees_the_probe_and_keeps_the_count():
    clock = Clock()
    b = CircuitBreakers(failure_threshold=2, cooldown_s=5, clock=clock)
    b.on_failure("d")
    b.on_no_answer("d")  # closed: the failure count stays
    assert b.on_failure("d") is True
    clock.now += 5
    b.on_attempt("d")
    assert not b.allows("d")
    b.on_no_answer("d")
    assert b.state("d") == HALF_OPEN and b.allows("d"), "another request may probe"
    b.on_no_answer("never-seen")
    assert b.state("never-seen") == CLOSED


# --- what the gateway feeds the breakers (gateway.core.fleet.outcomes) -------------------------------------

GATEWAY_YAML = """
state: {url: "memory://"}
deployments:
  d: {backend: remote, url: "http://127.0.0.1:9", protocol: kserve_v2}
models:
  m: {routes: [{deployment: d}]}
"""


def _half_open_outcomes(tmp_path):  # type: ignore[no-untyped-def]
    """A real deployment (never opened) whose circuit is half-open with its probe in flight."""
    from gateway.config import parse_config
    from gateway.core.fleet.deployments import build_deployments
    from gateway.core.fleet.outcomes import Outcomes
    from router.load import ServiceTimes
    from router.planner import Router

    config = parse_config(GATEWAY_YAML, base_dir=tmp_path, env={})
    dep = build_deployments(config, {})["d"]
    clock = Clock()
    breakers = CircuitBreakers(failure_threshold=1, cooldown_s=5, clock=clock)
    outcomes = Outcomes(breakers, Router(config.models, is_healthy=breakers.allows), ServiceTimes())
    breakers.on_failure("d")
    clock.now += 5
    breakers.on_attempt("d")
    assert breakers.state("d") == HALF_OPEN and not breakers.allows("d")
    return outcomes, dep, breakers


def _non_answers() -> list[BaseException]:
    import asyncio

    from policies.fair_queue.errors import QueueDeadlineExceeded, QueueFull

    return [
        asyncio.CancelledError(),
        QueueFull.deployment(8, retry_after_s=1.0),
        QueueFull.tenant("t", 4, retry_after_s=1.0),
        QueueDeadlineExceeded("deadline passed in the queue"),
    ]


@pytest.mark.parametrize("error", _non_answers(), ids=lambda e: type(e).__name__)
def test_a_probe_without_an_answer_does_not_close_the_circuit(tmp_path, error):
    outcomes, dep, breakers = _half_open_outcomes(tmp_path)
    outcomes.record("m", dep, error, 0.5)
    assert breakers.state("d") == HALF_OPEN, "a dead deployment must not be closed by a non-answer"
    assert breakers.allows("d"), "the next request may probe"


@pytest.mark.parametrize(
    "error",
    [None, InvalidInput("input 'x' has shape [1, 3], expected [1, 4]"), ModelNotFound("no model")],
    ids=lambda e: type(e).__name__,
)
def test_an_answer_closes_the_circuit_and_a_fault_reopens_it(tmp_path, error):
    outcomes, dep, breakers = _half_open_outcomes(tmp_path)
    outcomes.record("m", dep, error, 0.01)
    assert breakers.state("d") == CLOSED
    outcomes, dep, breakers = _half_open_outcomes(tmp_path)
    outcomes.record("m", dep, BackendTimeout("no answer in time"), 0.01)
    assert breakers.state("d") == OPEN and not breakers.allows("d")


@pytest.mark.parametrize("cooldown_s", [float("nan"), float("inf"), 0.0])
def test_cooldown_must_be_finite_and_positive(cooldown_s):
    with pytest.raises(ValueError, match="cooldown_s"):
        CircuitBreakers(cooldown_s=cooldown_s)
