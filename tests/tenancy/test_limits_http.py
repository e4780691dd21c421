"""Rate limits, quotas and revocation through a running gateway, in each protocol's envelope."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.servers import serve_app
from tests.tenancy.conftest import (
    ADMIN_HEADERS,
    admin_create_key,
    bearer,
    chat_body,
    deployments_yaml,
    models_yaml,
    tf_body,
    v2_body,
)

RPM = 5
RATE_HEADERS = ("x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests")


@pytest.fixture(scope="module")
def url(digits, upstream_url, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:  # type: ignore[no-untyped-def]
    state = tmp_path_factory.mktemp("limits") / "state.db"
    text = f"""
state: {{url: "sqlite:///{state}"}}
tenants:
  metered: {{models: ["digits", "chat"], key_limits: {{requests_per_minute: {RPM}}}}}
  shared: {{models: ["digits"], limits: {{requests_per_minute: 4}}}}
  budget: {{models: ["digits", "chat"], quotas: {{requests_per_day: 3}}}}
  clumsy: {{models: ["digits"], quotas: {{requests_per_day: 2}}}}
  free: {{}}
{deployments_yaml(digits, upstream_url)}
{models_yaml(["digits"], ["chat"])}
"""
    with serve_app(create_app(parse_config(text, base_dir=Path(".")))) as base:
        yield base


# protocol -> (path, body); the OpenAI path answers errors in the OpenAI envelope, the others {"error": str}
CALLS = {
    "openai": ("/v1/chat/completions", chat_body("chat")),
    "v2": ("/v2/models/digits/infer", v2_body()),
    "tfserving": ("/v1/models/digits:predict", tf_body()),
}


def _post(url: str, protocol: str, key: str) -> httpx.Response:
    path, body = CALLS[protocol]
    return httpx.post(url + path, json=body, headers=bearer(key), timeout=30)


@pytest.mark.parametrize("protocol", list(CALLS))
def test_requests_per_minute_per_key(url: str, protocol: str) -> None:
    key, _ = admin_create_key(url, "metered")  # per-key limits: a fresh key has a full bucket
    for i in range(RPM):
        r = _post(url, protocol, key)
        assert r.status_code == 200, (i, r.text)
        assert r.headers["x-ratelimit-limit-requests"] == str(RPM)
        assert r.headers["x-ratelimit-remaining-requests"] == str(RPM - 1 - i)
        assert r.headers["x-ratelimit-reset-requests"]
    refused = _post(url, protocol, key)
    assert refused.status_code == 429, refused.text
    # One slot refills every 60 / RPM = 12 s: the caller is told to wait about that long.
    assert 1 <= int(refused.headers["retry-after"]) <= 60 / RPM + 1
    for name in RATE_HEADERS:
        assert name in refused.headers, name
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert re.fullmatch(r"\d+(\.\d+)?(ms|s)|\d+m\d+s", refused.headers["x-ratelimit-reset-requests"])
    body = refused.json()
    if protocol == "openai":
        assert body["error"]["type"] == "rate_limit_error"
        assert body["error"]["code"] == "rate_limit_exceeded"
        assert "requests_per_minute" in body["error"]["message"]
    else:
        assert isinstance(body["error"], str) and "requests_per_minute" in body["error"]
    assert key not in refused.text
    # Another key of the same tenant has its own bucket.
    other, _ = admin_create_key(url, "metered")
    assert _post(url, protocol, other).status_code == 200


def test_requests_per_minute_per_tenant_is_shared_by_its_keys(url: str) -> None:
    k1, _ = admin_create_key(url, "shared")
    k2, _ = admin_create_key(url, "shared")
    statuses = [_post(url, "v2", k).status_code for k in (k1, k2, k1, k2)]
    assert statuses == [200] * 4
    assert _post(url, "v2", k1).status_code == 429
    assert _post(url, "v2", k2).status_code == 429


def test_unlimited_tenant_is_not_limited_nor_given_headers_it_has_no_limit_for(url: str) -> None:
    key, _ = admin_create_key(url, "free")
    for _ in range(RPM + 2):
        r = _post(url, "tfserving", key)
        assert r.status_code == 200
    assert "x-ratelimit-limit-requests" not in r.headers


def test_requests_per_day_quota(url: str) -> None:
    key, _ = admin_create_key(url, "budget")
    for _ in range(3):
        assert _post(url, "openai", key).status_code == 200
    before = datetime.now(UTC)
    refused = _post(url, "openai", key)
    assert refused.status_code == 429, refused.text
    err = refused.json()["error"]
    assert err["code"] == "quota_exceeded" and err["type"] == "rate_limit_error"
    # The message names the reset time: the next UTC midnight.
    midnight = (before + timedelta(days=1)).strftime("%Y-%m-%dT00:00:00Z")
    assert midnight in err["message"], err["message"]
    assert "requests_per_day" in err["message"] or "per_day" in err["message"]
    wait = (datetime.fromisoformat(midnight.replace("Z", "+00:00")) - before).total_seconds()
    assert abs(int(refused.headers["retry-after"]) - wait) <= 5
    # The quota is the tenant's: a new key and another protocol are refused too, in their envelope.
    other, _ = admin_create_key(url, "budget")
    v2 = _post(url, "v2", other)
    assert v2.status_code == 429 and midnight in v2.json()["error"]
    # The refused requests are not counted as usage.
    rows = httpx.get(f"{url}/admin/usage", params={"tenant": "budget"}, headers=ADMIN_HEADERS).json()["usage"]
    days = [r for r in rows if len(r["period"]) == 10]
    assert sum(r["requests"] for r in days) == 3, rows


def test_requests_that_fail_cost_no_usage_and_no_request_quota(url: str) -> None:
    """A backend 400 (wrong shape) is answered but not charged: README, "What a failure costs"."""
    key, _ = admin_create_key(url, "clumsy")
    wrong = {"inputs": [{"name": "input", "shape": [1, 63], "datatype": "FP32", "data": [0.0] * 63}]}
    for _ in range(5):
        r = httpx.post(f"{url}/v2/models/digits/infer", json=wrong, headers=bearer(key), timeout=30)
        assert r.status_code == 400, r.text
    for _ in range(2):  # the whole daily quota of 2 is still there
        assert _post(url, "v2", key).status_code == 200
    assert _post(url, "v2", key).status_code == 429
    rows = httpx.get(f"{url}/admin/usage", params={"tenant": "clumsy"}, headers=ADMIN_HEADERS).json()["usage"]
    assert sum(r["requests"] for r in rows if len(r["period"]) == 10) == 2, rows


def test_revoked_key_gets_401_within_one_second(url: str) -> None:
    key, key_id = admin_create_key(url, "free")
    assert _post(url, "v2", key).status_code == 200  # now cached by the key service
    revoked = httpx.delete(f"{url}/admin/keys/{key_id}", headers=ADMIN_HEADERS)
    assert revoked.status_code == 200
    t0 = time.monotonic()
    while (r := _post(url, "v2", key)).status_code != 401:
        assert r.status_code == 200
        assert time.monotonic() - t0 < 1.0, "a revoked key still served after 1 s"
        time.sleep(0.02)
    assert "revoked" in r.json()["error"]
    for protocol in CALLS:
        assert _post(url, protocol, key).status_code == 401
