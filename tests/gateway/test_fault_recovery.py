"""Fault test: one of two real upstream fleetgates dies under load; no request fails; it recovers.

Runs one repetition of bench/bench_router_recovery.py: three `fleetgate serve` processes (two
upstreams serving digits with ONNX Runtime, a front gateway with two `remote` kserve_v2 deployments
over them, 50/50), four client threads on the front, SIGKILL of one upstream, restart on its port.
"""

from __future__ import annotations

import time

import structlog

from bench.bench_router_recovery import Load, fleet, kill_and_recover

log = structlog.get_logger(__name__)
COOLDOWN_S = 0.5


def test_killed_upstream_fails_no_request_and_recovers_after_the_cooldown(digits, tmp_path):
    with fleet(digits.onnx_path, tmp_path, cooldown_s=COOLDOWN_S) as fleet_, Load(fleet_) as load:
        rep = kill_and_recover(fleet_, load)
        recovered = time.monotonic()
        time.sleep(1.0)
        after = [r.deployment.split(";")[0] for r in load.since(recovered)]
    failed = [r for r in load.results if r.status != 200]
    log.info("fault_recovery", **rep.__dict__, requests=len(load.results))
    assert failed == [], failed[:5]
    assert rep.outage_requests > 20, "the outage was really under load"
    # the breaker lets a probe through at most one cool-down after the last failed one
    assert rep.recovery_s < COOLDOWN_S + 1.0
    assert after.count("up-a") / len(after) > 0.25, "back to its share of the 50/50 split"
