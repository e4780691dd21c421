"""What a priced stream cut by its client spends: its worst case (`max_tokens` at the output price)
is reserved on the tenant's budget at admission, and once the client goes away the budget holds
exactly what the delivered part cost, the same amount its usage row records; nothing of the
reservation is left behind."""

from __future__ import annotations

import time

import pytest

from backends.remote.errors import UpstreamMalformed
from gateway.core.service import GatewayCore
from gateway.core.streams import estimate_text_tokens
from policies.budgets import budget_checks
from tests.gateway.test_stream_accounting import WORDS, open_core, remote_request, remote_yaml, start

#: one prompt token costs 1000 micro-USD, one output token 2000, a request 10000
PRICED = "pricing: {input_usd_per_mtok: 1000, output_usd_per_mtok: 2000, usd_per_request: 0.01}"


def priced_yaml(upstream_url: str, pricing: str = PRICED) -> str:
    """The remote deployment priced at `pricing`, tenant acme with a daily budget of 1 USD."""
    yaml = remote_yaml(upstream_url)
    yaml = yaml.replace("tenants: {acme: {}}", "tenants: {acme: {budget: {usd_per_day: 1.0}}}")
    return yaml.replace("api_key_env: TEST_UPSTREAM_KEY", f"api_key_env: TEST_UPSTREAM_KEY\n    {pricing}")


async def budget_held(core: GatewayCore) -> int:
    """The tenant's daily budget counter: spent plus reserved, in micro-USD (read with a 0 op)."""
    (check,) = [c for c in budget_checks("acme", None, core.config.tenants["acme"].budget, time.time())
                if c.name == "usd_per_day"]  # fmt: skip
    result = await core.admission._store.acquire(  # noqa: SLF001 - the counter itself is the point
        lease_id="", lease_ttl_s=0.0, buckets=[], leases=[], counters=[check.op(0)], now=time.time()
    )
    return result.counters[0]


async def day_cost_micros(core: GatewayCore) -> int:
    rows = [r for r in await core.admission.usage("acme") if len(r.period) == 10]
    return round(sum(r.cost_usd for r in rows) * 1_000_000)


async def test_a_cut_stream_leaves_its_real_cost_on_the_budget(upstream_url: str) -> None:
    async with open_core(priced_yaml(upstream_url)) as core:
        prompt_est = estimate_text_tokens(" ".join(WORDS))
        events = await start(core, "echo", remote_request("spend-cut", max_tokens=40))
        text = ""
        for _ in range(5):
            text += (await anext(events)).text
        reserved = await budget_held(core)
        # while it streams, the worst case is held: the prompt, 40 tokens of output, the request
        assert reserved == prompt_est * 1000 + 40 * 2000 + 10_000
        await events.aclose()  # the client goes away
        delivered = estimate_text_tokens(text)
        spent = await day_cost_micros(core)
        assert 0 < spent < reserved
        assert spent == prompt_est * 1000 + delivered * 2000 + 10_000, (spent, prompt_est, delivered)
        assert await budget_held(core) == spent  # the rest of the reservation is given back


async def test_a_whole_stream_settles_at_its_reported_usage(upstream_url: str) -> None:
    async with open_core(priced_yaml(upstream_url)) as core:
        events = await start(core, "echo", remote_request("spend-all", max_tokens=10))
        async for _ in events:
            pass
        # the upstream reports 40 prompt words and 10 output words: 40 x 1000 + 10 x 2000 + 10000
        assert await day_cost_micros(core) == 70_000
        assert await budget_held(core) == 70_000


@pytest.mark.parametrize("streamed", [True, False])
async def test_prompt_tokens_an_upstream_served_from_its_cache_take_the_cached_price(
    upstream_url: str, streamed: bool
) -> None:
    """An upstream's `prompt_tokens_details.cached_tokens` (its prompt cache) reaches the usage, and
    those tokens are charged at `cached_input_usd_per_mtok`, streamed from the upstream or whole."""
    priced = "pricing: {input_usd_per_mtok: 1000, cached_input_usd_per_mtok: 250, output_usd_per_mtok: 2000}"
    async with open_core(priced_yaml(upstream_url, priced)) as core:
        request = remote_request(f"cached-{streamed}", max_tokens=10)
        request.prompt = f"{request.prompt} cached-30"  # the test upstream then reports 30 cached
        request.stream = streamed
        last = [event async for event in await start(core, "echo", request)][-1]
        assert last.usage is not None and (last.usage.prompt_tokens, last.usage.cached_prompt_tokens) == (41, 30)
        # 11 prompt tokens computed, 30 cached, 10 output
        assert await day_cost_micros(core) == 11 * 1000 + 30 * 250 + 10 * 2000


@pytest.mark.parametrize("streamed", [True, False])
@pytest.mark.parametrize("broken", ["malformed-usage", "negative-usage"])
async def test_a_malformed_upstream_usage_is_an_upstream_error_not_a_crash(
    upstream_url: str, streamed: bool, broken: str
) -> None:
    async with open_core(priced_yaml(upstream_url)) as core:
        request = remote_request(f"{broken}-{streamed}", max_tokens=4)
        request.prompt = f"{broken} please"
        request.stream = streamed
        with pytest.raises(UpstreamMalformed, match="malformed"):
            async for _ in await start(core, "echo", request):
                pass
