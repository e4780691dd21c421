"""Canary watch: compare a canary route with its model's baseline, roll it back when it misbehaves.

Every attempt on a deployment of a model that has canary routes is recorded as an outcome (time,
ok, latency). The canary's outcomes and the baseline's (all non-canary routes of the model, pooled)
are kept over the canary's sliding window (`window_s`, and at most `MAX_SAMPLES` outcomes each, so
the cost of a check stays bounded under heavy traffic). Once the canary has `min_requests` outcomes
in the window it is judged after each of its outcomes:

- errors: its error rate minus the baseline's (0 without a baseline sample) above `max_error_rate`;
- latency: the median latency of its successful outcomes above `max_latency_ratio` times the
  baseline's median (checked only once the baseline also has `min_requests` successes). The median
  rather than the mean, so one slow outlier cannot roll a canary back.

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


class Rollback(msgspec.Struct, frozen=True, kw_only=True):
    """Why a canary was rolled back (what the log line and the admin status show)."""

    model: str
    deployment: str
    #: "error_rate" or "latency"
    reason: str
    #: monotonic time of the rollback
    at: float
    canary_requests: int
    canary_error_rate: float
    baseline_error_rate: float
    canary_p50_s: float | None = None
    baseline_p50_s: float | None = None


class CanaryStatus(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    deployment: str
    rolled_back: bool
    #: outcomes of the canary in its window now
    window_requests: int
    window_errors: int
    rollback: Rollback | None = None


@dataclass
class _Window:
    samples: deque[tuple[float, bool, float]] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))

    def prune(self, since: float) -> None:
        while self.samples and self.samples[0][0] < since:
            self.samples.popleft()

    def error_rate(self) -> float:
        if not self.samples:
            return 0.0
        return sum(not ok for _, ok, _ in self.samples) / len(self.samples)

    def latencies(self) -> list[float]:
        return [latency for _, ok, latency in self.samples if ok]


@dataclass
class _Canary:
    policy: CanaryConfig
    window: _Window = field(default_factory=_Window)
    rollback: Rollback | None = None


class CanaryMonitor:
    """Watches every canary route of every model.

    Args:
        clock: monotonic seconds (injected in tests).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._canaries: dict[tuple[str, str], _Canary] = {}
        #: model -> baseline deployments, and their pooled outcomes
        self._baseline_names: dict[str, frozenset[str]] = {}
        self._baselines: dict[str, _Window] = {}

    def configure(self, models: Mapping[str, ModelConfig]) -> None:
        """Adopt the canary routes of `models` (at start and on every reload; see the module doc)."""
        canaries: dict[tuple[str, str], _Canary] = {}
        names: dict[str, frozenset[str]] = {}
        for model, spec in models.items():
            policies = spec.canaries()
            if not policies:
                continue
            names[model] = frozenset(r.deployment for r in spec.routes if r.deployment not in policies)
            for deployment, policy in policies.items():
                old = self._canaries.get((model, deployment))
                canary = _Canary(policy=policy)
                if old is not None:
                    canary.window, canary.rollback = old.window, old.rollback
                canaries[(model, deployment)] = canary
        self._canaries = canaries
        self._baseline_names = names
        self._baselines = {m: self._baselines.get(m) or _Window() for m in names}

    def watches(self, model: str) -> bool:
        """Whether outcomes of this model are worth recording (it has canary routes)."""
        return model in self._baseline_names

    def rolled_back(self, model: str, deployment: str) -> bool:
        canary = self._canaries.get((model, deployment))
        return canary is not None and canary.rollback is not None

    def record(self, model: str, deployment: str, ok: bool, latency_s: float) -> Rollback | None:
        """Record one attempt's outcome; returns the Rollback when this outcome caused one."""
        now = self._clock()
        canary = self._canaries.get((model, deployment))
        if canary is not None:
            if canary.rollback is not None:
                return None  # already out; explicit-version traffic does not re-judge it
            canary.window.samples.append((now, ok, latency_s))
            return self._judge(model, deployment, canary, now)
        if deployment in self._baseline_names.get(model, ()):
            self._baselines[model].samples.append((now, ok, latency_s))
        return None

    def _judge(self, model: str, deployment: str, canary: _Canary, now: float) -> Rollback | None:
        policy = canary.policy
        since = now - policy.window_s
        canary.window.prune(since)
        count = len(canary.window.samples)
        if count < policy.min_requests:
            return None
        baseline = _Window(deque(s for s in self._baselines[model].samples if s[0] >= since))
        error_rate, base_error_rate = canary.window.error_rate(), baseline.error_rate()
        reason = None
        p50 = base_p50 = None
        if error_rate - base_error_rate > policy.max_error_rate:
            reason = "error_rate"
        elif policy.max_latency_ratio is not None:
            ok_latencies, base_latencies = canary.window.latencies(), baseline.latencies()
            if ok_latencies and len(base_latencies) >= policy.min_requests:
                p50, base_p50 = statistics.median(ok_latencies), statistics.median(base_latencies)
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
        return was

    def status(self) -> list[CanaryStatus]:
        out = []
        now = self._clock()
        for (model, deployment), canary in sorted(self._canaries.items()):
            canary.window.prune(now - canary.policy.window_s)
            samples = canary.window.samples
            out.append(
                CanaryStatus(
                    model=model,
                    deployment=deployment,
                    rolled_back=canary.rollback is not None,
                    window_requests=len(samples),
                    window_errors=sum(not ok for _, ok, _ in samples),
                    rollback=canary.rollback,
                )
            )
        return out
