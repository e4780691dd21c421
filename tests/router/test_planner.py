"""Router: weighted sticky splits, versions and labels, fallbacks, shadows."""

from __future__ import annotations

import random

import pytest

from backends.errors import ModelNotFound
from policies.principal import Principal
from router.planner import Router, split_model_name
from router.spec import ModelConfig, RouteConfig, ShadowConfig


def _router(weights: tuple[float, float] = (90, 10), sticky: str = "key", **kw) -> Router:  # type: ignore[no-untyped-def]
    spec = ModelConfig(
        routes=[
            RouteConfig(deployment="a", weight=weights[0]),
            RouteConfig(deployment="b", weight=weights[1]),
        ],
        sticky=sticky,
        **kw,
    )
    return Router({"m": spec}, is_healthy=lambda name: True, rng=random.Random(0))


def _user(i: int) -> Principal:
    return Principal(tenant=f"t{i}", key_id=f"k{i}")


def test_split_accuracy_over_10000_requests():
    router = _router(sticky="none")
    share = sum(router.plan("m").primary == "b" for _ in range(10_000)) / 10_000
    assert abs(share - 0.10) <= 0.015


def test_sticky_users_keep_their_variant_and_the_split_holds():
    router = _router()
    first = {i: router.plan("m", principal=_user(i)).primary for i in range(10_000)}
    again = {i: router.plan("m", principal=_user(i)).primary for i in range(10_000)}
    assert first == again
    assert abs(sum(v == "b" for v in first.values()) / 10_000 - 0.10) <= 0.015


def test_weight_change_moves_only_the_users_it_must():
    before = {i: _router((90, 10)).plan("m", principal=_user(i)).primary for i in range(10_000)}
    after = {i: _router((80, 20)).plan("m", principal=_user(i)).primary for i in range(10_000)}
    moved = [i for i in before if before[i] != after[i]]
    assert all(before[i] == "a" and after[i] == "b" for i in moved)
    assert abs(len(moved) / 10_000 - 0.10) <= 0.015


def test_header_stickiness():
    router = _router(sticky="header:x-user")
    seen = {router.plan("m", headers={"x-user": "alice"}).primary for _ in range(50)}
    assert len(seen) == 1


def test_unhealthy_route_is_skipped_and_becomes_a_fallback():
    spec = ModelConfig(
        routes=[RouteConfig(deployment="a", weight=50), RouteConfig(deployment="b", weight=50)],
        fallback=["c"],
    )
    router = Router({"m": spec}, is_healthy=lambda name: name != "a")
    plans = [router.plan("m", principal=_user(i)) for i in range(200)]
    assert {p.primary for p in plans} == {"b"}
    assert plans[0].fallbacks == ("c", "a")


def test_versions_and_labels():
    router = _router(versions={"1": "a", "2": "b"}, labels={"canary": "2"})
    assert router.plan("m", version="1").primary == "a"
    assert router.plan("m", label="canary").primary == "b"
    with pytest.raises(ModelNotFound, match="no version '3'"):
        router.plan("m", version="3")
    with pytest.raises(ModelNotFound, match="no label 'x'"):
        router.plan("m", label="x")
    with pytest.raises(ModelNotFound):
        router.plan("ghost")


def test_shadow_fraction():
    router = _router(shadow=ShadowConfig(deployment="s", fraction=0.25))
    share = sum(bool(router.plan("m").shadows) for _ in range(4000)) / 4000
    assert 0.2 < share < 0.3


@pytest.mark.parametrize(
    ("name", "parsed"),
    [("m", ("m", None, None)), ("m:2", ("m", "2", None)), ("m@canary", ("m", None, "canary"))],
)
def test_split_model_name(name, parsed):
    assert split_model_name(name) == parsed


def _through_the_bucket(router: Router, model: str, principal: Principal) -> object:
    spec = router.get(model)
    return router._plan_by_bucket(model, spec, None, None, principal, {})  # noqa: SLF001


@pytest.mark.parametrize(
    "routes, fallback",
    [
        ([RouteConfig(deployment="a")], []),
        ([RouteConfig(deployment="a")], ["x", "a", "x", "y"]),  # itself and repeats left out, in order
        ([RouteConfig(deployment="a", weight=0), RouteConfig(deployment="b", weight=5)], []),
        ([RouteConfig(deployment="c", canary=True)], ["x"]),
    ],
)
@pytest.mark.parametrize("states", [("healthy", "rolled back", "down"), ("down", "rolled back")])
def test_a_model_with_one_live_route_gets_the_plan_its_bucket_would_give(routes, fallback, states):  # noqa: ANN001
    """One route of positive weight: the plan made once per config equals the bucket path's, with
    the route healthy or down, a canary route rolled back while healthy or down, and shadows
    sampled alike (the same seed on both sides)."""
    healthy = {"a": True, "b": True, "c": True}
    spec = ModelConfig(routes=routes, fallback=fallback, shadow=ShadowConfig(deployment="s", fraction=0.5))
    fast = Router({"m": spec}, is_healthy=lambda name: healthy.get(name, True), rng=random.Random(7))
    slow = Router({"m": spec}, is_healthy=lambda name: healthy.get(name, True), rng=random.Random(7))
    users = [_user(i) for i in range(20)]
    for state in states:
        if state == "down":
            healthy.update(a=False, b=False, c=False)
        if state == "rolled back" and "c" in spec.canaries():
            for router in (fast, slow):
                router.canaries._canaries[("m", "c")].rollback = object()  # noqa: SLF001
                assert router.canaries.rolled_back("m", "c")
        for u in users:
            assert fast.plan("m", principal=u) == _through_the_bucket(slow, "m", u), state


def test_one_route_plans_still_resolve_versions_and_labels():
    spec = ModelConfig(
        routes=[RouteConfig(deployment="a")], versions={"1": "a", "2": "b"}, labels={"stable": "2"}
    )
    router = Router({"m": spec}, is_healthy=lambda name: True, rng=random.Random(0))
    assert router.plan("m").primary == "a" and router.plan("m").version is None
    assert router.plan("m", version="2").primary == "b"
    assert router.plan("m", label="stable") == router.plan("m", version="2")
    with pytest.raises(ModelNotFound):
        router.plan("m", label="nope")
    with pytest.raises(ModelNotFound):
        router.plan("m", version="9")
    with pytest.raises(ModelNotFound):
        router.plan("other")


def test_one_route_plans_follow_a_reload_and_still_sample_shadows():
    router = Router(
        {"m": ModelConfig(routes=[RouteConfig(deployment="a")])},
        is_healthy=lambda n: True,
        rng=random.Random(0),
    )
    assert router.plan("m").primary == "a"
    assert router.plan("m") is router.plan("m")  # made once per config and shared, not per request
    router.update({"m": ModelConfig(routes=[RouteConfig(deployment="b")], fallback=["a"],
                                    shadow=ShadowConfig(deployment="s", fraction=0.5))})  # fmt: skip
    plans = [router.plan("m") for _ in range(2000)]
    assert {(p.primary, p.fallbacks) for p in plans} == {("b", ("a",))}
    assert abs(sum(p.shadows == ("s",) for p in plans) / 2000 - 0.5) < 0.05
    assert all(p.shadows in ((), ("s",)) for p in plans)
    # two routes again: the bucket decides, and the users split
    router.update({"m": ModelConfig(routes=[RouteConfig(deployment="a"), RouteConfig(deployment="b")])})
    assert {router.plan("m", principal=_user(i)).primary for i in range(200)} == {"a", "b"}
