"""The core's prices: a deployment's price wins over its model's, the worst case covers every
candidate, and the `n` choices of one prompt pay the prompt and the request price once."""

from __future__ import annotations

from typing import Any

from backends.base import Usage
from gateway.config.spec import DeploymentConfig
from gateway.core.fleet.deployments import Deployment
from gateway.core.money.prices import Prices
from gateway.core.streams import ChoiceShare
from policies import pricing
from policies.admission import Admission
from policies.principal import Principal
from policies.stores.memory import MemoryStore
from policies.types import TenantSpec
from router.spec import ModelConfig, RouteConfig

CHEAP = pricing.Pricing(input_usd_per_mtok=1.0, output_usd_per_mtok=2.0, usd_per_request=0.001)
DEAR = pricing.Pricing(input_usd_per_mtok=3.0, output_usd_per_mtok=6.0)


def _dep(name: str, price: pricing.Pricing | None) -> Deployment:
    spec = DeploymentConfig(backend="remote", url="http://127.0.0.1:9", protocol="openai", pricing=price)
    backend: Any = None  # prices read only the spec
    return Deployment(name=name, spec=spec, backend=backend, queue=backend)


DEPS = {"cheap": _dep("cheap", CHEAP), "dear": _dep("dear", DEAR), "plain": _dep("plain", None)}
MODELS = {"m": ModelConfig(routes=[RouteConfig(deployment="plain")], pricing=pricing.Pricing(usd_per_request=0.5))}


def test_a_deployments_price_wins_and_the_worst_case_covers_each_candidate() -> None:
    prices = Prices(DEPS, lambda: MODELS)
    assert prices.of("m", "cheap") == CHEAP and prices.of("m", "plain") == MODELS["m"].pricing
    assert prices.of("other", "plain") is None
    worst = prices.worst("m", [DEPS["cheap"], DEPS["dear"]], input_tokens=100, max_output_tokens=50)
    for dep in ("cheap", "dear"):
        used = pricing.Usage(input_tokens=100, output_tokens=50)
        assert prices.charge("acme", "m", DEPS[dep], used) <= worst
    assert worst == 100 * 3 + 50 * 6 + 1000  # the dearest token prices and the request price


async def _share(deps: dict[str, Deployment], models: dict, tokens: int) -> tuple[Admission, ChoiceShare]:
    """Two choices of one admitted request of tenant acme, priced at `deps` and `models`."""
    adm = Admission(MemoryStore(), {"acme": TenantSpec()}, lambda: 1_764_000_000.0)
    reservation = await adm.admit(Principal("acme", "0123456789ab"), "m", tokens)
    return adm, ChoiceShare(adm, Prices(deps, lambda: models), reservation, 2)


#: a deployment whose cached prompt tokens cost a quarter of the others
CACHED = {"c": _dep("c", pricing.Pricing(input_usd_per_mtok=4.0, cached_input_usd_per_mtok=1.0, output_usd_per_mtok=8.0))}


async def test_n_choices_pay_the_prompt_and_the_request_once() -> None:
    adm, share = await _share(DEPS, MODELS, 2 * (10 + 8))
    await share.settle(Usage(prompt_tokens=10, completion_tokens=5), False, DEPS["cheap"])
    await share.settle(Usage(prompt_tokens=10, completion_tokens=7), False, DEPS["cheap"])
    (_, day) = await adm.usage("acme")
    assert day.cost_usd == (10 * 1 + 12 * 2 + 1000) / 1e6 and day.tokens == 22
    key_days = [r for r in await adm.key_usage("acme") if r.period == day.period]
    assert [(r.deployment, r.requests) for r in key_days] == [("cheap", 1)]


async def test_cached_prompt_tokens_take_the_cached_input_price_at_the_least_every_choice_found() -> None:
    adm, share = await _share(CACHED, {}, 2 * (100 + 8))
    await share.settle(Usage(prompt_tokens=100, completion_tokens=5, cached_prompt_tokens=96), False, CACHED["c"])
    await share.settle(Usage(prompt_tokens=100, completion_tokens=5, cached_prompt_tokens=64), False, CACHED["c"])
    (_, day) = await adm.usage("acme")
    # the prompt once: 64 cached (what both found), 36 computed; both choices' output
    assert day.cost_usd == (36 * 4 + 64 * 1 + 10 * 8) / 1e6


async def test_after_a_fallback_the_cached_tokens_are_those_of_the_deployment_that_answered() -> None:
    """n = 2: one choice started on a first deployment and was closed (its usage knows no cache) when
    the other could not start there; both then ran on a second one, which found 96 tokens cached."""
    adm, share = await _share(CACHED, {}, 2 * (100 + 8))
    share.begin_attempt(None, None)  # type: ignore[arg-type]
    await share.settle(Usage(prompt_tokens=100, completion_tokens=0), True, CACHED["c"])
    share.abandon_attempt()
    share.begin_attempt(None, None)  # type: ignore[arg-type]
    for _ in range(2):
        await share.settle(Usage(prompt_tokens=100, completion_tokens=5, cached_prompt_tokens=96), False, CACHED["c"])
    (_, day) = await adm.usage("acme")
    assert day.cost_usd == (4 * 4 + 96 * 1 + 10 * 8) / 1e6
