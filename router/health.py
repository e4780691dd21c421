"""Circuit breakers: stop sending requests to a deployment that keeps failing, probe it later.

closed    -> requests flow; `failure_threshold` consecutive failures open the circuit.
open      -> the deployment is skipped (the router falls back) for `cooldown_s`.
half-open -> after the cool-down, one probe request is let through: success closes the circuit,
             failure opens it again for another cool-down, and a probe that got no answer at all
             (it timed out in the queue, its caller left) only frees the probe slot
             (`on_no_answer`), so another request can probe.
Pure Python with an injected clock, so tests move time instead of sleeping.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


@dataclass
class _Circuit:
    state: str = CLOSED
    failures: int = 0
    opened_at: float = 0.0
    probe_in_flight: bool = False


class CircuitBreakers:
    """One circuit per deployment name.

    Args:
        failure_threshold: consecutive failures that open a circuit.
        cooldown_s: how long an open circuit stays open before a probe is allowed.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(
        self,
        failure_threshold: int = 5,
        cooldown_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1 or not (math.isfinite(cooldown_s) and cooldown_s > 0):
            raise ValueError("failure_threshold must be >= 1 and cooldown_s a finite number > 0")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._circuits: dict[str, _Circuit] = {}

    def state(self, name: str) -> str:
        circuit = self._circuits.get(name)
        if circuit is None:
            return CLOSED
        if circuit.state == OPEN and self._clock() - circuit.opened_at >= self.cooldown_s:
            return HALF_OPEN
        return circuit.state

    def allows(self, name: str) -> bool:
        """Whether a request may be sent now (a half-open circuit allows one probe at a time)."""
        state = self.state(name)
        if state == CLOSED:
            return True
        if state == HALF_OPEN:
            return not self._circuits[name].probe_in_flight
        return False

    def on_attempt(self, name: str) -> None:
        """Call when a request is sent; marks the half-open probe as taken."""
        if self.state(name) == HALF_OPEN:
            circuit = self._circuits[name]
            circuit.state = HALF_OPEN
            circuit.probe_in_flight = True

    def on_success(self, name: str) -> None:
        """Record an answer from the deployment: the circuit closes and the failure count resets."""
        self._circuits.pop(name, None)

    def on_no_answer(self, name: str) -> None:
        """Record an attempt that ended without any answer from the deployment.

        It proves nothing either way: the state and the failure count stay as they are; a half-open
        circuit only lets the next probe go.
        """
        circuit = self._circuits.get(name)
        if circuit is not None:
            circuit.probe_in_flight = False

    def on_failure(self, name: str) -> bool:
        """Record a failure; returns True when this failure opened the circuit."""
        circuit = self._circuits.setdefault(name, _Circuit())
        was_probe = circuit.state == HALF_OPEN
        circuit.failures += 1
        circuit.probe_in_flight = False
        if was_probe or circuit.failures >= self.failure_threshold:
            opened = circuit.state != OPEN or was_probe
            circuit.state = OPEN
            circuit.opened_at = self._clock()
            return opened
        return False
