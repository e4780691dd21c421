"""The console's pure parts: session tokens, and traffic figures out of two metric snapshots."""

from __future__ import annotations

import pytest

from gateway.admin.console import session
from gateway.admin.console.traffic import TrafficWindow, figures, parse, quantile

KEY = "an-admin-key-0123456789"


def test_session_tokens_verify_only_with_their_key_and_before_expiry():
    token, issued = session.issue(KEY, now=1000.0)
    assert KEY not in token
    assert session.verify(KEY, token, now=1001.0) == issued
    assert session.verify(KEY, token, now=1000.0 + session.SESSION_S - 1).csrf == issued.csrf
    with pytest.raises(session.NotSignedIn, match="expired"):
        session.verify(KEY, token, now=1000.0 + session.SESSION_S)
    with pytest.raises(session.NotSignedIn, match="invalid"):
        session.verify("the-rotated-admin-key", token, now=1001.0)
    version, expires, nonce, mac = token.split(".")
    longer = f"{version}.{int(expires) + 3600}.{nonce}.{mac}"  # a cookie edited to last longer
    for forged in (longer, token[:-1] + ("0" if token[-1] != "0" else "1"), "", "v1.x.y.z", "v2" + token[2:]):
        with pytest.raises(session.NotSignedIn):
            session.verify(KEY, forged, now=1001.0)
    other_token, other = session.issue(KEY, now=1000.0)
    assert other_token != token and other.csrf != issued.csrf  # each session its own CSRF token


def _exposition(requests: int, errors: int, fast: int, slow: int, queued: int) -> str:
    """A /metrics text with `fast` requests under 5 ms and `slow` ones between 0.1 and 0.25 s."""
    total = fast + slow
    return f"""
# TYPE fleetgate_requests_total counter
fleetgate_requests_total{{protocol="v2",model="m",deployment="d",tenant="t",status="200"}} {requests - errors}
fleetgate_requests_total{{protocol="v2",model="m",deployment="d",tenant="t",status="503"}} {errors}
# TYPE fleetgate_request_duration_seconds histogram
fleetgate_request_duration_seconds_bucket{{protocol="v2",model="m",deployment="d",le="0.005"}} {fast}
fleetgate_request_duration_seconds_bucket{{protocol="v2",model="m",deployment="d",le="0.1"}} {fast}
fleetgate_request_duration_seconds_bucket{{protocol="v2",model="m",deployment="d",le="0.25"}} {total}
fleetgate_request_duration_seconds_bucket{{protocol="v2",model="m",deployment="d",le="+Inf"}} {total}
fleetgate_request_duration_seconds_count{{protocol="v2",model="m",deployment="d"}} {total}
fleetgate_request_duration_seconds_sum{{protocol="v2",model="m",deployment="d"}} 1.0
# TYPE fleetgate_queue_depth gauge
fleetgate_queue_depth{{deployment="d",tenant="t"}} {queued}
# TYPE fleetgate_llm_kv_cache_usage_perc gauge
fleetgate_llm_kv_cache_usage_perc{{deployment="d"}} 0.25
"""


def test_rates_and_percentiles_come_from_the_difference_of_two_snapshots():
    now = [100.0]
    window = TrafficWindow(clock=lambda: now[0])
    window.observe(_exposition(requests=50, errors=0, fast=50, slow=0, queued=0))
    now[0] += 5
    old, new = window.observe(_exposition(requests=150, errors=10, fast=148, slow=2, queued=3))
    out = figures(old, new, {"m": ["d"]}, ["t"])
    [model] = out["models"]
    assert out["window_s"] == 5.0
    assert model["requests_per_s"] == pytest.approx(20.0) and model["errors_per_s"] == pytest.approx(2.0)
    assert model["total"] == 150 and model["queued"] == 3
    assert 0 < model["p50_ms"] <= 5.0  # 98 of the 100 new requests were under 5 ms
    assert 100 < model["p99_ms"] <= 250  # the 99th and 100th were slow
    [tenant] = out["tenants"]
    assert tenant["requests_per_s"] == pytest.approx(20.0) and tenant["queued"] == 3
    assert out["kv_cache"] == [{"deployment": "d", "usage": 0.25}]
    now[0] += 30  # snapshots older than the window are dropped: the rate is over the last 10 s
    old, _ = window.observe(_exposition(requests=150, errors=10, fast=148, slow=2, queued=0))
    assert figures(old, old, {"m": ["d"]}, ["t"])["models"][0]["requests_per_s"] is None


def test_quantile_of_no_new_observations_is_unknown():
    snap = parse(_exposition(requests=5, errors=0, fast=5, slow=0, queued=0), 0.0)
    assert quantile(0.5, snap.buckets["m"], snap.buckets["m"]) is None
    assert quantile(0.5, {0.1: 4.0, float("inf"): 10.0}, {}) == pytest.approx(0.1)  # beyond the last bound
