"""Where budget events go: a log line, /metrics, and an optional webhook, never on the request path.

`Admission` finds the thresholds a budget passes and takes each one once across replicas (a counter
in the store that admits one increment); this sink announces what it was handed. A webhook POST runs
in a task of its own with a timeout: a slow or failing receiver is logged and never delays or fails
a request.
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import structlog

from gateway.observe import metrics
from policies.budgets import BudgetAlerts, BudgetCheck, BudgetEvent

log = structlog.get_logger(__name__)


class BudgetAlertSink:
    """Announces budget events and keeps /metrics' budget gauge current.

    Args:
        config: the `budget_alerts:` section (thresholds are read by `Admission`; the webhook here).
    """

    def __init__(self, config: BudgetAlerts) -> None:
        self.config = config
        self._client: httpx.AsyncClient | None = None
        self._posts: set[asyncio.Task[None]] = set()

    def level(self, check: BudgetCheck, used_micros: int) -> None:
        """A tenant budget's counter as an admission saw it (keys are not metric labels)."""
        if check.key_id is None and check.limit_micros > 0:
            ratio = used_micros / check.limit_micros
            metrics.child(metrics.BUDGET_USED, check.tenant, check.name).set(ratio)

    def announce(self, event: BudgetEvent) -> None:
        """Log, count and (when configured) POST one event."""
        owner = "tenant" if event.key_id is None else "key"
        log.warning("budget_threshold_passed", **msgspec.structs.asdict(event))
        metrics.BUDGET_ALERTS.labels(event.tenant, owner, event.budget, f"{event.threshold:g}").inc()
        if self.config.webhook_url is None:
            return
        task = asyncio.ensure_future(self._post(event))
        self._posts.add(task)
        task.add_done_callback(self._posts.discard)

    async def _post(self, event: BudgetEvent) -> None:
        url = self.config.webhook_url
        assert url is not None
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.config.webhook_timeout_s)
        try:
            answer = await self._client.post(url, content=msgspec.json.encode(event), headers=_JSON)
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            # the URL may carry a token (query, userinfo), and httpx's messages may quote it: log the
            # host and the error's class only
            log.warning("budget_webhook_failed", host=httpx.URL(url).host, error=type(exc).__name__)
            return
        if answer.is_error:
            log.warning("budget_webhook_failed", host=httpx.URL(url).host, status=answer.status_code)

    async def close(self) -> None:
        """Wait for the POSTs in flight (each bounded by its timeout), then close the client."""
        if self._posts:
            await asyncio.gather(*self._posts, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None


_JSON = {"content-type": "application/json"}
