"""One call through the gateway, whatever its protocol: what the adapter extracted, and its record.

A protocol adapter (gateway/http/, the gRPC servicers in gateway/grpc/) turns its wire request into
a `Call`: the protocol, the credentials it found, the request's metadata (HTTP headers or gRPC
metadata, names lower-cased) and a `ModelRef` where the model is named outside the payload. The
core (`gateway/core/service.py`) takes the call from there in one pass and fills in who it was for and who
served it; `done()` writes the one access-log line and the request metrics at the end.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from secrets import token_hex as random_hex

import structlog

from fleetgate.errors import Protocol
from gateway.observe import metrics
from policies.principal import Principal

log = structlog.get_logger("fleetgate.access")


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A model as a caller names it: the name, and at most one of a version or a label."""

    name: str
    version: str | None = None
    label: str | None = None


#: model names that may appear as metric labels: those of every config this process has served.
#: Anything else a client writes in a URL or body is labelled "unknown", so made-up names cannot
#: grow /metrics or the caches below (both live as long as the process).
_metric_models: set[str] = set()


def register_metric_models(names: Iterable[str]) -> None:
    """Allow these model names as metric labels (called at start-up and on each reload)."""
    _metric_models.update(names)


def _model_label(model: str) -> str:
    return model if not model or model in _metric_models else "unknown"


class Call:
    """One request's bookkeeping: id, timing, labels, and the single access-log line at the end."""

    __slots__ = (
        "protocol",
        "request_id",
        "echo_id",
        "started",
        "model",
        "deployment",
        "backend",
        "device",
        "tenant",
        "headers",
        "api_key",
        "principal",
        "authenticated_ns",
    )

    def __init__(self, protocol: Protocol, headers: Mapping[str, str], api_key: str | None = None) -> None:
        self.protocol = protocol
        #: request metadata, names lower-cased: routing (sticky keys, canary headers) and queue hints
        self.headers = headers
        #: the credential the adapter found (None: the caller sent none)
        self.api_key = api_key
        #: who the call is for when the gateway itself makes it (a batch job's line, run as the
        #: job's tenant) or the body hook checked its key already: `identify` takes it instead of a
        #: credential. Never set from what a request says.
        self.principal: Principal | None = None
        #: (start, end) in ns since the epoch of a key check made before the core opened the
        #: request's span (a typed route's body hook, gateway/http/bodies.py): the core starts the span
        #: there and records the check as its `authenticate` step
        self.authenticated_ns: tuple[int, int] | None = None
        # The gateway's own id keys the request everywhere inside (engine, aborts, shadows): a
        # client-chosen id could collide with, reveal or abort another tenant's request. 128 random
        # bits as 32 hex digits.
        self.request_id = random_hex(16)
        #: what the response's x-request-id carries: the client's own id when it sent a sane one
        self.echo_id = _client_request_id(headers.get("x-request-id")) or self.request_id
        self.started = time.perf_counter()
        self.model = ""
        self.deployment = ""
        self.backend = ""
        self.device = ""
        self.tenant = ""

    @property
    def span_start_ns(self) -> int | None:
        """Where the request's span starts: at the body hook's key check when one ran before the span
        was opened, else (None) when it is opened."""
        return None if self.authenticated_ns is None else self.authenticated_ns[0]

    def served_by(self, deployment: str, backend: str, device: str) -> None:
        self.deployment, self.backend, self.device = deployment, backend, device

    def done(self, status: int, error: str | None = None) -> None:
        elapsed = time.perf_counter() - self.started
        model = _model_label(self.model)
        metrics.child(metrics.REQUESTS, self.protocol, model, self.deployment, self.tenant, str(status)).inc()
        if model:
            metrics.child(metrics.REQUEST_LATENCY, self.protocol, model, self.deployment).observe(elapsed)
        log.info(
            "request",
            request_id=self.request_id,
            client_request_id=self.echo_id if self.echo_id != self.request_id else None,
            protocol=self.protocol,
            tenant=self.tenant or None,
            model=self.model or None,
            deployment=self.deployment or None,
            backend=self.backend or None,
            device=self.device or None,
            status=status,
            latency_ms=round(elapsed * 1000, 3),
            error=error,
        )


#: a client's x-request-id is echoed and logged only when it is short and printable
_MAX_CLIENT_ID = 128


def _client_request_id(value: str | None) -> str | None:
    if not value or len(value) > _MAX_CLIENT_ID or not value.isprintable() or not value.isascii():
        return None
    return value
