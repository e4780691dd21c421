"""What each console page shows, gathered from the live core (no HTML here: templates escape it).

Each function returns plain dicts and lists for one template. They read the same objects the admin
API reads (the key service, the usage store, the router, the deployments), so the console never
shows a figure the API would not.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from gateway.core.service import GatewayCore
from policies.audit import AuditEntry
from policies.types import KeyRecord, KeyUsageRow, UsageRow

#: the widest bar of a usage chart, in SVG units
CHART_WIDTH = 170


def _limits(spec: Any) -> dict[str, int]:
    """The limits or quotas that are set (None means unlimited and is left out)."""
    return {k: v for k, v in msgspec.structs.asdict(spec).items() if v is not None}


def _chart(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bar lengths for the tenant's chart: spend in USD where its models are priced, else tokens,
    else requests."""
    measure = next((m for m in ("cost_usd", "tokens") if any(r[m] for r in rows)), "requests")
    top = max((r[measure] for r in rows), default=0) or 1
    return [
        {
            "label": r["model"],
            "value": r[measure],
            "unit": "USD" if measure == "cost_usd" else measure,
            "y": 18 * i,
            "width": max(1, round(CHART_WIDTH * r[measure] / top)),
        }
        for i, r in enumerate(rows)
    ]


async def tenants(core: GatewayCore, now: datetime | None = None) -> dict[str, Any]:
    """Every configured tenant: weight, models, limits, quotas and this month's usage per model."""
    now = now or datetime.now(UTC)
    month, day = now.strftime("%Y-%m"), now.strftime("%Y-%m-%d")
    usage: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
    rows_all = await core.admission.usage(None)
    for row in rows_all:
        if row.period in (month, day):
            usage[row.tenant][row.model]["month" if row.period == month else "day"] = _counts(row)
    days = daily(rows_all, month)
    out = []
    for name, spec in sorted(core.config.tenants.items()):
        rows = [
            {
                "model": model,
                **periods.get("month", _NONE),
                "today": periods.get("day", _NONE),
            }
            for model, periods in sorted(usage[name].items())
        ]
        out.append(
            {
                "name": name,
                "weight": spec.weight,
                "models": spec.models,
                "limits": _limits(spec.limits),
                "quotas": _limits(spec.quotas),
                "key_limits": _limits(spec.key_limits) if spec.key_limits is not None else {},
                "budget": _limits(spec.budget) if spec.budget is not None else {},
                "usage": rows,
                "chart": _chart(rows),
                "chart_height": 18 * len(rows),
                # spend over time: one bar a day of this month, every model together
                "days": _chart(days.get(name, [])),
                "days_height": 18 * len(days.get(name, [])),
            }
        )
    return {"tenants": out, "month": month, "day": day}


_NONE: dict[str, float] = {"requests": 0, "tokens": 0, "cost_usd": 0.0}


def daily(rows: list[UsageRow], month: str) -> dict[str, list[dict[str, Any]]]:
    """Each tenant's days of `month` with usage, oldest first, summed over its models: rows for
    `_chart`, labelled by date (the day rows are `YYYY-MM-DD`, the month's own row is left out)."""
    days: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        if len(row.period) != len("YYYY-MM-DD") or not row.period.startswith(f"{month}-"):
            continue
        sums = days[row.tenant].setdefault(row.period, {"model": row.period, **dict.fromkeys(_NONE, 0)})
        for name, value in _counts(row).items():
            sums[name] += value
    return {tenant: [by_day[d] for d in sorted(by_day)] for tenant, by_day in days.items()}


def _counts(row: UsageRow) -> dict[str, float]:
    return {"requests": row.requests, "tokens": row.tokens, "cost_usd": row.cost_usd}


#: the height of a key's spend-per-day bars, in SVG units (each day a bar 3 units wide)
SPARK_HEIGHT = 16


def key_spend(rows: list[KeyUsageRow], now: datetime | None = None) -> dict[str, dict[str, Any]]:
    """Each key's spend in USD this month and today (UTC), and per day of this month as bars (its
    spend over time), from its usage rows."""
    now = now or datetime.now(UTC)
    month = now.strftime("%Y-%m")
    periods = {month: "month", now.strftime("%Y-%m-%d"): "today"}
    spend: dict[str, dict[str, Any]] = defaultdict(lambda: {"month": 0.0, "today": 0.0, "days": [0.0] * now.day})
    for r in rows:
        if r.period in periods:
            spend[r.key_id][periods[r.period]] += r.cost_usd
        if r.period.startswith(f"{month}-") and len(r.period) == len("YYYY-MM-DD"):
            spend[r.key_id]["days"][int(r.period[-2:]) - 1] += r.cost_usd
    for figures in spend.values():
        figures["bars"] = _spark(figures.pop("days"))
    return spend


def _spark(days: list[float]) -> list[dict[str, int]]:
    """Bars of a small chart of spend per day, scaled to the month's dearest day (days with no
    spend have none)."""
    top = max(days, default=0.0) or 1.0
    bars = []
    for i, value in enumerate(days):
        height = max(1, round(SPARK_HEIGHT * value / top)) if value > 0 else 0
        if height:
            bars.append({"x": 3 * i, "y": SPARK_HEIGHT - height, "height": height})
    return bars


def key_rows(records: list[KeyRecord], spend: dict[str, dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The keys table: newest first, state spelled out, spend this month and today."""
    spend = spend or {}
    now = datetime.now(UTC).timestamp()
    rows = []
    for r in reversed(records):
        state = "revoked" if r.revoked_at else ("active" if r.active(now) else "expired")
        rows.append(
            {
                "key_id": r.key_id,
                "prefix": f"fg-{r.key_id}-…",
                "tenant": r.tenant,
                "name": r.name or "",
                "models": ", ".join(r.models),
                "spend": spend.get(r.key_id, {"month": 0.0, "today": 0.0, "bars": []}),
                # the key's own limits and budget (beside its tenant's)
                "own": {k: v for spec in (r.limits, r.budget) if spec is not None for k, v in _limits(spec).items()},
                "created": _when(r.created_at),
                "expires": _when(r.expires_at),
                "last_used": _when(r.last_used_at),
                "state": state,
            }
        )
    return rows


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S UTC") if value is not None else ""


def shadow_figures(text: str) -> dict[tuple[str, str], dict[str, float]]:
    """Per (model, shadow deployment): requests mirrored by outcome, answers compared, exact text
    matches, and the mean of the per-request max |difference|, out of the /metrics text."""
    out: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    names = {
        "fleetgate_shadow_compared_total": "compared",
        "fleetgate_shadow_exact_match_total": "exact_match",
        "fleetgate_shadow_shape_mismatch_total": "shape_mismatch",
        "fleetgate_shadow_max_abs_diff_sum": "abs_diff_sum",
        "fleetgate_shadow_max_abs_diff_count": "abs_diff_count",
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = (sample.labels.get("model", ""), sample.labels.get("shadow", ""))
            if sample.name == "fleetgate_shadow_requests_total":
                out[key][sample.labels.get("outcome", "")] += sample.value
            elif sample.name in names:
                out[key][names[sample.name]] += sample.value
    for figures in out.values():
        count = figures.pop("abs_diff_count", 0.0)
        total = figures.pop("abs_diff_sum", 0.0)
        figures["mean_max_abs_diff"] = total / count if count else float("nan")
    return out


def models(core: GatewayCore, metrics_text: str) -> dict[str, Any]:
    """Every served model (routes, effective weights, canaries, shadow, fallbacks) and every deployment."""
    canaries = {(c.model, c.deployment): c for c in core.router.canaries.status()}
    shadows = shadow_figures(metrics_text)
    out = []
    for name in sorted(core.router.names()):
        spec = core.router.get(name)
        effective = core.router.effective_weights(name)
        routes = []
        for route in spec.routes:
            canary = canaries.get((name, route.deployment))
            routes.append(
                {
                    "deployment": route.deployment,
                    "weight": route.weight,
                    "effective": effective.get(route.deployment, 0.0),
                    "canary": canary,
                    "is_canary": bool(route.canary),
                }
            )
        shadow = None
        if spec.shadow is not None:
            shadow = {
                "deployment": spec.shadow.deployment,
                "fraction": spec.shadow.fraction,
                "figures": dict(shadows.get((name, spec.shadow.deployment), {})),
            }
        out.append(
            {
                "name": name,
                "routes": routes,
                "sticky": spec.sticky,
                "balance": spec.balance,
                "fallback": spec.fallback,
                "versions": spec.versions,
                "labels": spec.labels,
                "shadow": shadow,
                "adapter_of": core.adapter_models.get(name),
            }
        )
    return {"models": out, "graphs": graphs(core), "deployments": deployments(core), "reloadable": True}


def graphs(core: GatewayCore) -> list[dict[str, Any]]:
    """Each model graph: its steps (the model each calls, its condition), outputs and readiness."""
    out = []
    for name, graph in sorted(core.config.graphs.items()):
        steps = []
        for step_name, step in graph.steps.items():
            when = step.when
            condition = ""
            if when is not None:
                bounds = [f"< {when.below:g}" if when.below is not None else "",
                          f">= {when.at_least:g}" if when.at_least is not None else ""]  # fmt: skip
                rows = "per row" if when.per_row else "whole request"
                condition = f"{when.reduce}({when.tensor}) {' and '.join(b for b in bounds if b)}, {rows}"
            inputs = ", ".join(f"{k} ← {v}" for k, v in step.inputs.items())
            steps.append({"name": step_name, "model": step.model, "inputs": inputs, "when": condition})
        outputs = {k: v if isinstance(v, str) else " | ".join(v) for k, v in graph.outputs.items()}
        out.append({"name": name, "ready": core.graphs.ready(name), "steps": steps, "outputs": outputs})
    return out


def deployments(core: GatewayCore) -> list[dict[str, Any]]:
    """Each deployment: readiness, backend, device, hardware, its breaker and its queue now."""
    rows = []
    for name, dep in sorted(core.deployments.items()):
        stats = dep.queue.stats()
        rows.append(
            {
                "name": name,
                "ready": dep.ready,
                "backend": dep.spec.backend,
                "device": dep.device,
                "hardware": dep.hardware,
                "breaker": core.breakers.state(name),
                "error": dep.load_error or "",
                "policy": stats.policy,
                "in_flight": stats.in_flight,
                "max_concurrency": stats.max_concurrency,
                "queued": stats.depth,
            }
        )
    return rows


def model_deployments(core: GatewayCore) -> dict[str, list[str]]:
    """Each served model's route deployments (for its queue depth on the traffic page)."""
    return {
        name: [r.deployment for r in core.router.get(name).routes] for name in sorted(core.router.names())
    }


def audit_rows(entries: list[AuditEntry]) -> list[dict[str, Any]]:
    """Audit entries as table rows: the time in UTC, before and after as compact JSON."""

    def compact(value: Any) -> str:
        return "–" if value is None else msgspec.json.encode(value).decode()

    return [
        {
            "id": e.id,
            "when": datetime.fromtimestamp(e.at, UTC).strftime("%Y-%m-%d %H:%M:%S"),
            "actor": e.actor,
            "via": e.via,
            "client": e.client,
            "action": e.action,
            "target": e.target,
            "before": compact(e.before),
            "after": compact(e.after),
        }
        for e in entries
    ]
