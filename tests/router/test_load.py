"""Least-expected-wait pools and the service-time estimate."""

from __future__ import annotations

import pytest

from policies.principal import Principal
from router.load import ServiceTimes, expected_wait
from router.planner import Router
from router.spec import ModelConfig, RouteConfig


def _router(waits: dict[str, float], balance: str = "least_wait") -> Router:
    spec = ModelConfig(
        routes=[
            RouteConfig(deployment="gpu", weight=45),
            RouteConfig(deployment="cpu", weight=45),
            RouteConfig(deployment="cand", weight=10, canary=True),
        ],
        sticky="key",
        balance=balance,  # type: ignore[arg-type]
    )
    return Router({"m": spec}, is_healthy=lambda name: True, expected_wait=lambda name: waits[name])


def _users(n: int) -> list[Principal]:
    return [Principal(tenant="t", key_id=f"k{i}") for i in range(n)]


def test_pool_goes_to_the_least_expected_wait():
    waits = {"gpu": 0.5, "cpu": 0.01, "cand": 0.0}
    router = _router(waits)
    chosen = [router.plan("m", principal=u).primary for u in _users(2000)]
    share = {d: chosen.count(d) / len(chosen) for d in waits}
    assert share["gpu"] == 0.0
    assert share["cpu"] == pytest.approx(0.9, abs=0.03)
    assert share["cand"] == pytest.approx(0.1, abs=0.03), "a canary is never pooled"
    waits.update(gpu=0.001)
    assert all(router.plan("m", principal=u).primary in ("gpu", "cand") for u in _users(200))


def test_ties_spread_by_bucket_and_weighted_balance_stays_sticky():
    router = _router({"gpu": 0.0, "cpu": 0.0, "cand": 0.0})
    chosen = [router.plan("m", principal=u).primary for u in _users(2000)]
    assert 0.4 < chosen.count("gpu") / chosen.count("cpu") < 2.5
    weighted = _router({"gpu": 9.0, "cpu": 0.0, "cand": 0.0}, balance="weighted")
    first = [weighted.plan("m", principal=u).primary for u in _users(2000)]
    assert first.count("gpu") / len(first) == pytest.approx(0.45, abs=0.03), "waits ignored"


def test_unhealthy_pool_member_is_skipped():
    spec = ModelConfig(
        routes=[RouteConfig(deployment="gpu", weight=50), RouteConfig(deployment="cpu", weight=50)],
        balance="least_wait",
    )
    router = Router(
        {"m": spec}, is_healthy=lambda n: n != "cpu", expected_wait=lambda n: 0.0 if n == "cpu" else 1
    )
    plan = router.plan("m", principal=Principal(tenant="t", key_id="k"))
    assert plan.primary == "gpu" and plan.fallbacks == ("cpu",)


def test_expected_wait_and_ewma():
    times = ServiceTimes(alpha=0.5)
    assert times.get("d") is None
    assert expected_wait(0, 0, 4, None) < expected_wait(0, 1, 4, None), "no estimate: load still counts"
    times.observe("d", 0.1)
    times.observe("d", 0.3)
    assert times.get("d") == pytest.approx(0.2)
    assert expected_wait(queued=3, in_flight=4, slots=4, service_s=0.2) == pytest.approx(0.4)
    assert expected_wait(queued=0, in_flight=0, slots=1, service_s=0.05) < expected_wait(0, 0, 1, 0.2)
