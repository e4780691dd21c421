"""Step record: who served a call, on the call (access log, metrics) and on its request span; and
the span's start and end attributes (never a key, a prompt or a payload)."""

from __future__ import annotations

from typing import Any

from backends.errors import ModelNotFound
from gateway.core.calls import Call, ModelRef
from gateway.core.results import Served


def record_server(call: Call, served: Served, span: Any = None) -> None:
    """Step record: who served, on the call (access log, metrics) and on the request span."""
    dep = served.deployment
    # a graph has no one deployment: its steps' are in its response header (and their spans)
    name, backend = (dep.name, dep.spec.backend) if dep is not None else ("", "graph")
    call.served_by(name, backend, dep.device if dep is not None else "")
    if span is not None:
        span.set_attributes(
            {
                "fleetgate.tenant": call.tenant,
                "fleetgate.model": call.model,
                "fleetgate.deployment": name,
                "fleetgate.backend": backend,
            }
        )


def check_graph_version(model: ModelRef) -> None:
    """A graph has no versions or labels: asking for one is asking for something that does not exist."""
    if model.version is not None or model.label is not None:
        raise ModelNotFound(f"graph {model.name!r} has no versions or labels; call it by its name")


def span_attributes(call: Call) -> dict[str, Any]:
    """A request span's attributes: never the key, the prompt or the payload."""
    return {
        "fleetgate.protocol": call.protocol,
        "fleetgate.model": call.model or None,
        "fleetgate.request_id": call.request_id,
    }


def end_span(span: Any, error: BaseException | None = None) -> None:
    if span is None:
        return
    if error is not None:
        span.set_attribute("error.type", type(error).__name__)
    span.end()
