"""Canary watch with an injected clock: error and latency bounds, window, minimum sample, restore."""

from __future__ import annotations

import pytest

from policies.principal import Principal
from router.canary import CanaryMonitor
from router.planner import Router
from router.spec import CanaryConfig, ModelConfig, RouteConfig

POLICY = CanaryConfig(max_error_rate=0.1, max_latency_ratio=2.0, window_s=30, min_requests=20)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _models(policy: CanaryConfig | bool = POLICY, canary: str = "c") -> dict[str, ModelConfig]:
    return {
        "m": ModelConfig(
            routes=[
                RouteConfig(deployment="a", weight=90),
                RouteConfig(deployment=canary, weight=10, canary=policy),
            ]
        )
    }


def _monitor() -> tuple[CanaryMonitor, Clock]:
    clock = Clock()
    monitor = CanaryMonitor(clock)
    monitor.configure(_models())
    return monitor, clock


def _feed(monitor: CanaryMonitor, deployment: str, n: int, fail_every: int = 0, latency: float = 0.01):
    """n outcomes; every `fail_every`-th fails. Returns the index of the outcome that rolled back."""
    for i in range(n):
        ok = not (fail_every and i % fail_every == fail_every - 1)
        if monitor.record("m", deployment, ok, latency) is not None:
            return i
    return None


def test_error_rate_breach_after_the_minimum_sample():
    monitor, _ = _monitor()
    _feed(monitor, "a", 100)
    # 1 in 3 fails (33%): judged only from the 20th outcome on, and breached right there
    assert _feed(monitor, "c", 100, fail_every=3) == 19
    assert monitor.rolled_back("m", "c")
    (status,) = monitor.status()
    assert status.rollback is not None and status.rollback.reason == "error_rate"
    assert status.rollback.canary_requests == 20


def test_error_rate_is_judged_against_the_baseline():
    monitor, _ = _monitor()
    _feed(monitor, "a", 100, fail_every=4)  # the baseline fails 25% too: the canary is no worse
    assert _feed(monitor, "c", 100, fail_every=3) is None
    assert not monitor.rolled_back("m", "c")


def test_latency_breach_uses_medians():
    monitor, _ = _monitor()
    _feed(monitor, "a", 50, latency=0.010)
    assert _feed(monitor, "c", 19, latency=0.025) is None
    assert monitor.record("m", "c", True, 0.025) is not None
    assert monitor.status()[0].rollback.reason == "latency"  # type: ignore[union-attr]

    monitor, _ = _monitor()
    _feed(monitor, "a", 50, latency=0.010)
    assert _feed(monitor, "c", 100, latency=0.019) is None, "1.9x is within a 2.0 ratio"


def test_old_outcomes_leave_the_window():
    monitor, clock = _monitor()
    _feed(monitor, "c", 15, fail_every=2)  # 7 failures, not judged yet (15 < 20)
    clock.now += 31  # all of them fall out of the 30 s window
    assert _feed(monitor, "c", 19) is None
    assert monitor.status()[0].window_requests == 19
    assert _feed(monitor, "c", 1) is None, "20 clean outcomes in the window: no breach"


def test_restore_and_a_fresh_window():
    monitor, _ = _monitor()
    _feed(monitor, "c", 30, fail_every=2)
    assert monitor.rolled_back("m", "c")
    assert monitor.record("m", "c", False, 0.01) is None, "a rolled-back canary is not re-judged"
    assert monitor.restore("m", "c") is True
    assert not monitor.rolled_back("m", "c")
    assert monitor.status()[0].window_requests == 0
    assert monitor.restore("m", "c") is False
    with pytest.raises(KeyError):
        monitor.restore("m", "a")


def test_reload_keeps_rollbacks_of_routes_that_stay_canaries():
    monitor, _ = _monitor()
    _feed(monitor, "c", 30, fail_every=2)
    monitor.configure(_models(CanaryConfig(max_error_rate=0.2)))  # new bounds, still a canary
    assert monitor.rolled_back("m", "c")
    monitor.configure(_models(policy=False))  # no longer a canary: state dropped
    assert not monitor.rolled_back("m", "c") and monitor.status() == []
    monitor.configure(_models())
    assert not monitor.rolled_back("m", "c"), "a canary again, fresh"


def test_rollback_moves_only_the_canarys_users():
    monitor, _ = _monitor()
    spec = ModelConfig(
        routes=[
            RouteConfig(deployment="a", weight=45),
            RouteConfig(deployment="b", weight=45),
            RouteConfig(deployment="c", weight=10, canary=POLICY),
        ],
        sticky="key",
    )
    router = Router({"m": spec}, is_healthy=lambda name: True, canaries=monitor)
    users = [Principal(tenant="t", key_id=f"k{i}") for i in range(5000)]
    before = [router.plan("m", principal=u).primary for u in users]
    assert router.plan("m", principal=users[0]).fallbacks  # the canary is a route like the others
    _feed(monitor, "c", 30, fail_every=2)
    assert router.effective_weights("m") == {"a": 45, "b": 45, "c": 0.0}
    after = [router.plan("m", principal=u).primary for u in users]
    assert "c" not in after
    assert all(x == y for x, y in zip(before, after, strict=True) if x != "c")
    moved = [y for x, y in zip(before, after, strict=True) if x == "c"]
    assert 0.4 < moved.count("a") / len(moved) < 0.6, "the canary's users spread over the baseline"
    assert all("c" not in router.plan("m", principal=u).fallbacks for u in users[:50])
    monitor.restore("m", "c")
    assert [router.plan("m", principal=u).primary for u in users] == before


def test_config_shapes(tmp_path):
    from gateway.config import ConfigError, parse_config

    def config(routes: str) -> str:
        return f"""
state: {{url: "memory://"}}
deployments:
  a: {{backend: remote, url: "http://x", protocol: kserve_v2}}
  c: {{backend: remote, url: "http://y", protocol: kserve_v2}}
models:
  m: {{routes: {routes}}}
breakers: {{failure_threshold: 2, cooldown_s: 0.5}}
"""

    parsed = parse_config(
        config("[{deployment: a, weight: 90}, {deployment: c, weight: 10, canary: {window_s: 5}}]"),
        base_dir=tmp_path,
    )
    assert parsed.models["m"].canaries()["c"].window_s == 5 and parsed.breakers.cooldown_s == 0.5
    with pytest.raises(ConfigError, match=r"a canary needs a baseline route .* - at `\$.models.m.routes`"):
        parse_config(config("[{deployment: c, canary: true}]"), base_dir=tmp_path)
    with pytest.raises(ConfigError, match="max_latency_ratio must be a finite number > 1"):
        parse_config(
            config(
                "[{deployment: a, weight: 90}, {deployment: c, weight: 10, canary: {max_latency_ratio: 1}}]"
            ),
            base_dir=tmp_path,
        )


def test_record_is_cheap_with_full_windows():
    """record() runs on the event loop for every attempt: with both windows full (MAX_SAMPLES each)
    a canary outcome must not copy or sort them (it used to cost ~0.4 ms; now ~1-2 us)."""
    import time

    from router.canary import MAX_SAMPLES

    monitor, clock = _monitor()
    policy = CanaryConfig(max_error_rate=1.0, max_latency_ratio=1000.0, window_s=600, min_requests=20)
    monitor.configure(_models(policy))
    for i in range(MAX_SAMPLES):
        clock.now += 0.001
        monitor.record("m", "a", i % 50 != 0, 0.01 + (i % 7) * 1e-3)
        monitor.record("m", "c", i % 50 != 0, 0.01 + (i % 5) * 1e-3)
    n = 2000
    started = time.perf_counter()
    for _ in range(n):
        clock.now += 0.001
        monitor.record("m", "c", True, 0.012)
    per_record = (time.perf_counter() - started) / n
    assert not monitor.rolled_back("m", "c")
    assert per_record < 50e-6, f"{per_record * 1e6:.0f} us per record"


def test_running_counts_follow_the_window_and_the_sample_cap():
    from router.canary import MAX_SAMPLES

    monitor, clock = _monitor()
    monitor.configure(_models(CanaryConfig(max_error_rate=1.0, window_s=30, min_requests=20)))
    for i in range(MAX_SAMPLES + 100):  # the first 100 (all failures) fall out by the cap
        monitor.record("m", "c", i >= 100, 0.01)
    assert monitor.status()[0].window_requests == MAX_SAMPLES
    assert monitor.status()[0].window_errors == 0
    clock.now += 10
    _feed(monitor, "c", 30, fail_every=3)
    assert monitor.status()[0].window_errors == 10
    clock.now += 25  # the first batch leaves the 30 s window, the second stays
    status = monitor.status()[0]
    assert (status.window_requests, status.window_errors) == (30, 10)


def test_latency_is_checked_within_the_documented_gap():
    """Medians are not recomputed after every outcome, but at most LATENCY_CHECK_MIN_GAP outcomes
    (in a small window) after the one where a check on every outcome would have rolled back."""
    from router.canary import LATENCY_CHECK_MIN_GAP

    monitor, _ = _monitor()
    _feed(monitor, "a", 50, latency=0.010)
    assert _feed(monitor, "c", 20, latency=0.010) is None  # judged at 20: fine
    # the median of the canary's answers exceeds 2 x 10 ms once slow ones are the majority: 21 of 41
    slow = _feed(monitor, "c", 100, latency=0.100)
    assert slow is not None and 20 <= slow <= 20 + LATENCY_CHECK_MIN_GAP
    assert monitor.status()[0].rollback.reason == "latency"  # type: ignore[union-attr]


def test_caller_errors_are_judged_against_the_baseline():
    """A candidate that refuses every request (400: its input signature changed) never faults, yet
    it must be rolled back; caller errors the baseline sees as well do not count against it."""
    monitor, _ = _monitor()
    _feed(monitor, "a", 100)
    for i in range(19):
        assert monitor.record("m", "c", True, 0.001, caller_error=True) is None, i
    rollback = monitor.record("m", "c", True, 0.001, caller_error=True)
    assert rollback is not None and rollback.reason == "caller_error_rate"
    assert (rollback.canary_caller_error_rate, rollback.baseline_caller_error_rate) == (1.0, 0.0)
    assert rollback.canary_error_rate == 0.0
    assert monitor.status()[0].window_caller_errors == 20

    monitor, _ = _monitor()
    for i in range(100):  # the same callers send the baseline bad requests 30% of the time
        monitor.record("m", "a", True, 0.01, caller_error=i % 10 < 3)
    for i in range(100):
        assert monitor.record("m", "c", True, 0.01, caller_error=i % 10 < 3) is None
    assert not monitor.rolled_back("m", "c")


def test_caller_errors_are_not_latency_samples():
    """Fast 400s must not pull the canary's median down and hide slow answers."""
    monitor, _ = _monitor()
    monitor.configure(_models(CanaryConfig(max_error_rate=0.6, max_latency_ratio=2.0, min_requests=20)))
    _feed(monitor, "a", 50, latency=0.010)
    for i in range(19):  # half of them refused at once, half answered in 3 x the baseline's time
        assert monitor.record("m", "c", True, 0.0001 if i % 2 else 0.030, caller_error=bool(i % 2)) is None
    rollback = monitor.record("m", "c", True, 0.030)
    assert rollback is not None and rollback.reason == "latency"
    assert rollback.canary_p50_s == 0.030 and rollback.canary_caller_error_rate == 0.45
