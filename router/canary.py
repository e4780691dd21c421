"""Canary watch: compare a canary route with its model's baseline, roll it back when it misbehaves.

Every attempt on a deployment of a model that has canary routes is recorded as an outcome (time,
kind, latency), where the kind is one of: an answer (ok), a fault of the deployment, or a caller
error (the deployment answered that the request is wrong: 4xx, e.g. InvalidInput). The canary's
outcomes and the baseline's (all non-canary routes of the model, pooled) are kept over the canary's
sliding window (`window_s`, and at most `MAX_SAMPLES` outcomes each, so memory stays bounded under
heavy traffic). Once the canary has `min_requests` outcomes in the window it is judged after each of
its outcomes:

- errors: its fault rate minus the baseline's (0 without a baseline sample) above `max_error_rate`;
- caller errors: its caller-error rate minus the baseline's, under the same `max_error_rate` bound.
  A candidate whose input signature changed answers 400 to everyone and never faults, so without
  this signal it would never be rolled back. The comparison is fair because the baseline sees the
  same callers; it is not when one caller that sends bad requests is pinned to the canary's slice
  by a sticky key (`sticky: tenant` with few tenants): such a caller can roll a canary back;
- latency: the median latency of its answers above `max_latency_ratio` times the baseline's median
  (checked only once the baseline also has `min_requests` answers). The median rather than the
  mean, so one slow outlier cannot roll a canary back. Caller errors are not latency samples (a
  fast 400 says nothing about how fast the model is).

Cost: `record` runs on the event loop for every attempt, so it is O(1) amortised. Each window keeps
running counts of faults and caller errors, updated as outcomes enter and leave it, which makes the
two rate checks O(1). Medians need a sort, so the latency check is not run after every outcome: it
runs at the first outcome that makes the canary eligible, and after that once
`max(LATENCY_CHECK_MIN_GAP, n // LATENCY_CHECK_FRACTION)` more canary outcomes have arrived, n being
the canary's outcomes in the window. Sorting n samples once per n/8 outcomes costs O(log n) per
outcome, and a latency regression is still caught within an eighth of a full window (or 8
outcomes) of when a check after every outcome would have caught it.

A breach rolls the canary back: the router gives it an effective weight of 0 until `restore()`.
Only the deployment's own faults count as errors (the gateway decides what a fault is); a request
retried on a fallback still counts as an error of the canary.

Reload (`configure`) keeps the state of every (model, deployment) that is still a canary route of
that model after the reload, so a rolled-back canary stays rolled back when an unrelated part of the
config changes; routes that are no longer canaries (or are gone) lose their state, and come back
fresh if they become canaries again. Pure Python with an injected clock.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec

from router.spec import CanaryConfig, ModelConfig

#: outcomes kept per window (canary or baseline); older ones fall out early under heavy traffic
MAX_SAMPLES = 4096
#: the latency check (a sort of each window) runs at most once per this many canary outcomes...
LATENCY_CHECK_MIN_GAP = 8
#: ...or per this fraction of the canary's window, whichever is more (see the module docstring)
LATENCY_CHECK_FRACTION = 8

# outcome kinds
_OK, _FAULT, _CALLER_ERROR = 0, 1, 2


class Rollback(msgspec.Struct, frozen=True, kw_only=True):
    """Why a canary was rolled back (what the log line and the admin status show)."""

    model: str
    deployment: str
    #: "error_rate", "caller_error_rate" or "latency"
    reason: str
    #: monotonic time of the rollback
    at: float
    canary_requests: int
    canary_error_rate: float
    baseline_error_rate: float
    canary_p50_s: float | None = None
    baseline_p50_s: float | None = None
    canary_caller_error_rate: float = 0.0
    baseline_caller_error_rate: float = 0.0


class CanaryStatus(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    deployment: str
    rolled_back: bool
    #: outcomes of the canary in its window now
    window_requests: int
    window_errors: int
    rollback: Rollback | None = None
    #: caller errors (4xx answers) of the canary in its window now
    window_caller_errors: int = 0


@dataclass
class _Window:
    """Outcomes over a sliding window, with running counts so rates cost O(1)."""

    samples: deque[tuple[float, int, float]] = field(default_factory=deque)
    faults: int = 0
    caller_errors: int = 0

    def add(self, at: float, kind: int, latency_s: float) -> None:
        if len(self.samples) >= MAX_SAMPLES:
            self._drop_oldest()
        self.samples.append((at, kind, latency_s))
        if kind == _FAULT:
            self.faults += 1
        elif kind == _CALLER_ERROR:
            self.caller_errors += 1

    def _drop_oldest(self) -> None:
        _, kind, _ = self.samples.popleft()
        if kind == _FAULT:
            self.faults -= 1
        elif kind == _CALLER_ERROR:
            self.caller_errors -= 1

    def prune(self, since: float) -> None:
        while self.samples and self.samples[0][0] < since:
            self._drop_oldest()

    @property
    def answers(self) -> int:
        """Outcomes that were neither faults nor caller errors (the latency samples)."""
        return len(self.samples) - self.faults - self.caller_errors

    def rate(self, count: int) -> float:
        return count / len(self.samples) if self.samples else 0.0

    def median_latency(self) -> float:
        return statistics.median(latency for _, kind, latency in self.samples if kind == _OK)


@dataclass
class _Canary:
    policy: CanaryConfig
    window: _Window = field(default_factory=_Window)
    #: the model's baseline outcomes, over this canary's window
    baseline: _Window = field(default_factory=_Window)
    rollback: Rollback | None = None
    #: canary outcomes to go before the next latency check (0: at the next eligible outcome)
    latency_check_in: int = 0


class CanaryMonitor:
    """Watches every canary route of every model.

    Args:
        clock: monotonic seconds (injected in tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._canaries: dict[tuple[str, str], _Canary] = {}
        #: model -> its baseline deployments, and the canaries their outcomes are compared with
        self._baseline_names: dict[str, frozenset[str]] = {}
        self._by_model: dict[str, list[_Canary]] = {}

    def configure(self, models: Mapping[str, ModelConfig]) -> None:
        """Adopt the canary routes of `models` (at start and on every reload; see the module doc)."""
        canaries: dict[tuple[str, str], _Canary] = {}
        names: dict[str, frozenset[str]] = {}
        by_model: dict[str, list[_Canary]] = {}
        for model, spec in models.items():
            policies = spec.canaries()
            if not policies:
                continue
            names[model] = frozenset(r.deployment for r in spec.routes if r.deployment not in policies)
            for deployment, policy in policies.items():
                old = self._canaries.get((model, deployment))
                canary = _Canary(policy=policy)
                if old is not None:
                    canary.window, canary.baseline, canary.rollback = old.window, old.baseline, old.rollback
                    canary.latency_check_in = old.latency_check_in
                canaries[(model, deployment)] = canary
                by_model.setdefault(model, []).append(canary)
        self._canaries = canaries
        self._baseline_names = names
        self._by_model = by_model

    def watches(self, model: str) -> bool:
        """Whether outcomes of this model are worth recording (it has canary routes)."""
        return model in self._baseline_names

    def rolled_back(self, model: str, deployment: str) -> bool:
        canary = self._canaries.get((model, deployment))
        return canary is not None and canary.rollback is not None

    def record(
        self, model: str, deployment: str, ok: bool, latency_s: float, *, caller_error: bool = False
    ) -> Rollback | None:
        """Record one attempt's outcome; returns the Rollback when this outcome caused one.

        Args:
            model: the logical model the attempt served.
            deployment: the deployment tried.
            ok: False when the attempt failed by the deployment's own fault.
            latency_s: the attempt as the caller saw it.
            caller_error: the deployment answered, refusing the request as the caller's mistake
                (4xx); counted in the caller-error rate, not as a fault or a latency sample.
        """
        now = self._clock()
        kind = _FAULT if not ok else _CALLER_ERROR if caller_error else _OK
        canary = self._canaries.get((model, deployment))
        if canary is not None:
            if canary.rollback is not None:
                return None  # already out; explicit-version traffic does not re-judge it
            canary.window.add(now, kind, latency_s)
            return self._judge(model, deployment, canary, now)
        if deployment in self._baseline_names.get(model, ()):
            for watcher in self._by_model[model]:
                watcher.baseline.prune(now - watcher.policy.window_s)
                watcher.baseline.add(now, kind, latency_s)
        return None

    def _judge(self, model: str, deployment: str, canary: _Canary, now: float) -> Rollback | None:
        policy, window, baseline = canary.policy, canary.window, canary.baseline
        since = now - policy.window_s
        window.prune(since)
        count = len(window.samples)
        if count < policy.min_requests:
            return None
        baseline.prune(since)
        error_rate, base_error_rate = window.rate(window.faults), baseline.rate(baseline.faults)
        caller_rate = window.rate(window.caller_errors)
        base_caller_rate = baseline.rate(baseline.caller_errors)
        reason = None
        p50 = base_p50 = None
        if error_rate - base_error_rate > policy.max_error_rate:
            reason = "error_rate"
        elif caller_rate - base_caller_rate > policy.max_error_rate:
            reason = "caller_error_rate"
        elif policy.max_latency_ratio is not None:
            canary.latency_check_in -= 1
            # the medians need a sort: only every so many outcomes (see the module docstring)
            if canary.latency_check_in <= 0 and window.answers and baseline.answers >= policy.min_requests:
                canary.latency_check_in = max(LATENCY_CHECK_MIN_GAP, count // LATENCY_CHECK_FRACTION)
                p50, base_p50 = window.median_latency(), baseline.median_latency()
                if p50 > policy.max_latency_ratio * base_p50:
                    reason = "latency"
        if reason is None:
            return None
        canary.rollback = Rollback(
            model=model,
            deployment=deployment,
            reason=reason,
            at=now,
            canary_requests=count,
            canary_error_rate=round(error_rate, 4),
            baseline_error_rate=round(base_error_rate, 4),
            canary_p50_s=p50,
            baseline_p50_s=base_p50,
            canary_caller_error_rate=round(caller_rate, 4),
            baseline_caller_error_rate=round(base_caller_rate, 4),
        )
        return canary.rollback

    def restore(self, model: str, deployment: str) -> bool:
        """Give a canary its configured weight back and start its window afresh.

        Returns whether it was rolled back. Raises KeyError when it is not a canary route.
        """
        canary = self._canaries[(model, deployment)]
        was = canary.rollback is not None
        canary.rollback = None
        canary.window = _Window()  # old failures must not roll it back again at once
        canary.latency_check_in = 0
        return was

    def status(self) -> list[CanaryStatus]:
        out = []
        now = self._clock()
        for (model, deployment), canary in sorted(self._canaries.items()):
            window = canary.window
            window.prune(now - canary.policy.window_s)
            out.append(
                CanaryStatus(
                    model=model,
                    deployment=deployment,
                    rolled_back=canary.rollback is not None,
                    window_requests=len(window.samples),
                    window_errors=window.faults,
                    rollback=canary.rollback,
                    window_caller_errors=window.caller_errors,
                )
            )
        return out
