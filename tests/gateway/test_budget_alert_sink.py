"""Budget events: a webhook that fails is logged without its secret parts and never raises; events
are counted on /metrics by tenant, owner and threshold."""

from __future__ import annotations

import structlog
from prometheus_client import REGISTRY

from gateway.core.money.alerts import BudgetAlertSink
from policies.budgets import BudgetAlerts, BudgetEvent
from tests.servers import free_port

EVENT = BudgetEvent(
    tenant="acme", key_id="0123456789ab", budget="usd_per_day", threshold=0.8, used_usd=0.8, limit_usd=1.0,
    resets_at="2026-11-28T00:00:00Z", counter="b:k:0123456789ab:usd:d:2026-11-27",
)  # fmt: skip


def _alerts() -> float:
    labels = {"tenant": "acme", "owner": "key", "budget": "usd_per_day", "threshold": "0.8"}
    return REGISTRY.get_sample_value("fleetgate_budget_alerts_total", labels) or 0.0


async def test_a_failing_webhook_is_logged_by_host_only_and_never_raises() -> None:
    url = f"http://user:pw@127.0.0.1:{free_port()}/hook?token=s3cret"  # nothing listens there
    sink = BudgetAlertSink(BudgetAlerts(webhook_url=url, webhook_timeout_s=2.0))
    before = _alerts()
    with structlog.testing.capture_logs() as logs:
        sink.announce(EVENT)
        await sink.close()
    events = [e["event"] for e in logs]
    assert events == ["budget_threshold_passed", "budget_webhook_failed"], logs
    failed = logs[1]
    assert failed["host"] == "127.0.0.1" and failed["error"] == "ConnectError"
    assert "s3cret" not in repr(logs) and "pw" not in repr(failed)
    assert _alerts() == before + 1
