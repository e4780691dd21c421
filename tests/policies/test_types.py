"""Tenant config sections: decoded from YAML-shaped data, invalid specs refused with the field named."""

from __future__ import annotations

import msgspec
import pytest

from policies.stores import open_store
from policies.types import Limits, Quotas, TenantSpec


def decode(data: object) -> dict[str, TenantSpec]:
    return msgspec.convert(data, dict[str, TenantSpec])


def test_full_spec_decodes() -> None:
    tenants = decode(
        {
            "acme": {
                "weight": 2,
                "limits": {"requests_per_minute": 600, "tokens_per_minute": 200000, "max_concurrency": 32},
                "quotas": {"tokens_per_day": 5000000, "requests_per_month": 1000000},
                "models": ["llama*", "digits"],
                "key_limits": {"requests_per_minute": 60},
            },
            "beta": {},
        }
    )
    assert tenants["acme"].limits == Limits(
        requests_per_minute=600, tokens_per_minute=200000, max_concurrency=32
    )
    assert tenants["acme"].quotas == Quotas(tokens_per_day=5000000, requests_per_month=1000000)
    assert tenants["acme"].allows_model("llama-cpu") and not tenants["acme"].allows_model("other")
    assert tenants["beta"] == TenantSpec() and tenants["beta"].models == ["*"]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"limits": {"requests_per_minute": 0}}, "requests_per_minute must be a positive integer"),
        ({"limits": {"tokens_per_minute": -5}}, "tokens_per_minute"),
        ({"limits": {"max_concurrency": True}}, "max_concurrency"),
        (
            {"limits": {"requests_per_minute": "100"}},
            "Expected `int | null`, got `str` - at `$[...].limits.requests_per_minute`",
        ),
        ({"limits": {"requests_per_hour": 5}}, "unknown field `requests_per_hour`"),
        ({"quotas": {"tokens_per_day": 0}}, "tokens_per_day"),
        ({"quotas": {"tokens_per_week": 1}}, "unknown field `tokens_per_week`"),
        ({"weight": 0}, "weight must be a positive"),
        ({"models": []}, "models must list at least one glob"),
        ({"models": [""]}, "models must be non-empty"),
        ({"key_limits": {"max_concurrency": -1}}, "max_concurrency"),
    ],
)
def test_invalid_specs_name_the_field(data: dict, expected: str) -> None:
    with pytest.raises(msgspec.ValidationError) as err:
        decode({"acme": data})
    assert expected in str(err.value)


async def test_unknown_store_url() -> None:
    with pytest.raises(ValueError, match="postgres"):
        await open_store("postgres://x")
    with pytest.raises(ValueError, match="needs a file path"):
        await open_store("sqlite:///")
