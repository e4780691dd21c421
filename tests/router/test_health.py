"""Circuit breakers with an injected clock."""

from __future__ import annotations

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
