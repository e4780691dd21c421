"""Prices of models and deployments, and what one request costs in micro-USD.

One currency, USD. Prices are configured as floats (`0.15` USD per million tokens) but every cost is
an integer number of micro-USD (1e-6 USD): stores add integers, so sums over many requests and many
replicas are exact, and a budget is an integer counter like a token quota. USD floats appear only
at the edges (config, usage rows, refusal messages).

A price per million tokens in USD is numerically the price of one token in micro-USD, so a request's
cost in micro-USD is `tokens x usd_per_mtok`; it is computed in decimal and rounded half up once per
request, so that the same usage always has the same cost and a larger usage never costs less (the
worst case reserved at admission always covers the real cost settled at the end).
"""

from __future__ import annotations

import functools
import math
from decimal import ROUND_HALF_UP, Decimal

import msgspec

from fleetgate.spec import SpecBase

#: micro-USD in one USD
MICROS_PER_USD = 1_000_000
#: the highest price a field may hold (100,000 USD per million tokens, per request or per row, far
#: above any real price): the stores keep costs in 64-bit integers (SQLite INTEGER, Redis INCRBY),
#: and a request's worst case at a price near float's range (1e300) overflowed them, a 500 on
#: every priced call; at this bound a request's worst case stays below 1e18 micro-USD
MAX_PRICE_USD = 100_000.0


class Pricing(SpecBase):
    """Prices of a model (`models.<name>.pricing`) or a deployment (`deployments.<name>.pricing`,
    which wins over its model's). Every field is optional; one left out costs nothing."""

    #: USD per million prompt tokens
    input_usd_per_mtok: float | None = None
    #: USD per million generated tokens
    output_usd_per_mtok: float | None = None
    #: USD per million prompt tokens served from a reused prefix (null: the input price)
    cached_input_usd_per_mtok: float | None = None
    #: USD per answered request, whatever its size
    usd_per_request: float | None = None
    #: USD per row (the batch dimension) of a tensor model's request
    usd_per_row: float | None = None

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not math.isfinite(value) or not 0 <= value <= MAX_PRICE_USD:
                raise ValueError(
                    f"pricing.{name} must be a number in 0..{MAX_PRICE_USD:g} (USD) or null, got {value!r}"
                )


#: the price of something that has none configured
FREE = Pricing()


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """What one request used, as priced: tokens by kind, tensor rows, answered requests (0 or 1)."""

    input_tokens: int = 0
    output_tokens: int = 0
    #: prompt tokens served from a reused prefix (a part of `input_tokens`, priced at the cached price)
    cached_tokens: int = 0
    rows: int = 0
    requests: int = 1


@functools.lru_cache(maxsize=256)
def _dec(value: float | None) -> Decimal:
    # str() first: Decimal(0.15) is 0.1499999999999999944..., the config said 0.15; cached, since a
    # config has a few prices and each request asks for them twice
    return Decimal(0) if value is None else Decimal(str(value))


def cost_micros(pricing: Pricing | None, usage: Usage) -> int:
    """The cost of `usage` at `pricing` in micro-USD (an int, rounded half up once).

    Raises:
        ValueError: a negative count, or cached tokens beyond the input tokens.
    """
    counts = (usage.input_tokens, usage.output_tokens, usage.cached_tokens, usage.rows, usage.requests)
    if any(n < 0 for n in counts):
        raise ValueError(f"usage counts must be >= 0, got {usage!r}")
    if usage.cached_tokens > usage.input_tokens:
        raise ValueError(f"cached_tokens ({usage.cached_tokens}) exceed input_tokens ({usage.input_tokens})")
    if pricing is None or pricing == FREE:
        return 0  # nothing priced: no decimal arithmetic on the request path
    p = pricing
    cached_price = p.cached_input_usd_per_mtok if p.cached_input_usd_per_mtok is not None else p.input_usd_per_mtok
    micros = (
        _dec(p.input_usd_per_mtok) * (usage.input_tokens - usage.cached_tokens)
        + _dec(cached_price) * usage.cached_tokens
        + _dec(p.output_usd_per_mtok) * usage.output_tokens
        + (_dec(p.usd_per_row) * usage.rows + _dec(p.usd_per_request) * usage.requests) * MICROS_PER_USD
    )
    return int(micros.to_integral_value(rounding=ROUND_HALF_UP))


def worst_case_micros(pricing: Pricing | None, *, input_tokens: int, max_output_tokens: int, rows: int = 0) -> int:
    """What a request may cost at most, reserved before it runs: every prompt token at the dearer
    of the input and cached-input prices, every allowed output token generated, plus its rows and
    the per-request price."""
    worst = cost_micros(
        pricing, Usage(input_tokens=input_tokens, output_tokens=max_output_tokens, rows=rows, requests=1)
    )
    if pricing is not None and pricing.cached_input_usd_per_mtok is not None:
        # a cached price above the input price (nothing forbids it) would let a reused prefix cost
        # more than the worst case reserved
        cached = Usage(
            input_tokens=input_tokens, cached_tokens=input_tokens, output_tokens=max_output_tokens, rows=rows
        )
        worst = max(worst, cost_micros(pricing, cached))
    return worst


def usd(micros: int) -> float:
    """micro-USD as USD (for the edges: JSON, messages, metrics)."""
    return micros / MICROS_PER_USD


def micros_of(usd_amount: float) -> int:
    """USD as micro-USD, rounded half up (a budget of 1.00 USD is exactly 1_000_000)."""
    return int((_dec(usd_amount) * MICROS_PER_USD).to_integral_value(rounding=ROUND_HALF_UP))


def costliest(prices: list[Pricing | None]) -> Pricing | None:
    """A price at least as high as each of `prices` on every item: what a request that may be served
    by any of several deployments (a plan's fallbacks) is reserved at. None when none is priced."""
    given = [p for p in prices if p is not None]
    if not given:
        return None
    if len(given) == 1:
        return given[0]

    def top(name: str) -> float | None:
        values = [getattr(p, name) for p in given if getattr(p, name) is not None]
        return max(values) if values else None

    inputs = [p.input_usd_per_mtok or 0.0 for p in given]
    cached = [
        p.cached_input_usd_per_mtok if p.cached_input_usd_per_mtok is not None else (p.input_usd_per_mtok or 0.0)
        for p in given
    ]
    return Pricing(
        input_usd_per_mtok=max(inputs),
        output_usd_per_mtok=top("output_usd_per_mtok"),
        cached_input_usd_per_mtok=max(cached),
        usd_per_request=top("usd_per_request"),
        usd_per_row=top("usd_per_row"),
    )
