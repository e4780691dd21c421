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
