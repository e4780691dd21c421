"""Traces as a collector receives them: OTLP/HTTP protobuf sent by a configured gateway, decoded with
the `opentelemetry-proto` classes; sampling and W3C `traceparent` rules; a collector that is down;
tracing changed by a config reload."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import structlog
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from backends.demo_models.digits import digits_split
from fleetgate import tracing
from fleetgate.otlp import OtlpHttpSender, SpanEncoder
from fleetgate.span_export import BatchSpanExport
from gateway.app import create_app
from gateway.config import load_config, parse_config
from tests.conftest import ADMIN_KEY, create_key
from tests.gateway.span_types import span_type  # noqa: F401 - a fixture
from tests.servers import free_port, serve_app

# every test here runs with C spans and with Python spans
pytestmark = pytest.mark.usefixtures("span_type")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


class _Collector(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    bodies: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        assert self.path == "/v1/traces" and self.headers["content-type"] == "application/x-protobuf"
        type(self).bodies.append(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def collector() -> Iterator[str]:
    _Collector.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/v1/traces"
    server.shutdown()


def _received() -> list[tuple[dict, SpanProto]]:
    """(resource attributes, span) for every span the collector received."""
    out = []
    for body in _Collector.bodies:
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                assert scope_spans.scope.name == "fleetgate"
                out += [(resource, s) for s in scope_spans.spans]
    return out


def _attributes(span: SpanProto) -> dict:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def test_a_configured_gateway_sends_its_traces_to_the_collector(digits, collector: str) -> None:  # noqa: ANN001
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments: {{ort: {{backend: onnxruntime, model: {digits.onnx_path}}}}}
models: {{digits: {{routes: [{{deployment: ort}}]}}}}
tracing: {{enabled: true, service_name: edge-gw, otlp_endpoint: "{collector}"}}
""",
        base_dir=Path("."),
    )
    row = digits_split()[1][0].tolist()
    good = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": row}]}
    bad = {"inputs": [{"name": "input", "shape": [1, 63], "datatype": "FP32", "data": row[:63]}]}
    with serve_app(create_app(config)) as url:
        key = create_key(url, "acme")
        headers = {"Authorization": f"Bearer {key}", "traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"}
        assert httpx.post(f"{url}/v2/models/digits/infer", json=good, headers=headers).status_code == 200
        plain = {"Authorization": f"Bearer {key}"}
        assert httpx.post(f"{url}/v2/models/digits/infer", json=bad, headers=plain).status_code == 400
    # the app has stopped: what was queued has been sent
    received = _received()
    assert received and all(resource["service.name"] == "edge-gw" for resource, _ in received)
    spans = [s for _, s in received]
    continued = [s for s in spans if s.trace_id.hex() == TRACE_ID]
    by_name = {s.name: s for s in continued}
    assert {"fleetgate.request", "authenticate", "route", "admit", "queue", "backend"} <= set(by_name)
    root = by_name["fleetgate.request"]
    assert root.parent_span_id.hex() == CLIENT_SPAN and root.kind == SpanProto.SPAN_KIND_SERVER
    assert root.flags == 0x301  # sampled, and the parent is another process's span
    for name in ("authenticate", "route", "admit", "queue", "backend"):
        child = by_name[name]
        assert child.parent_span_id == root.span_id and child.kind == SpanProto.SPAN_KIND_INTERNAL
        assert child.flags == 0x101
        assert root.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano
        assert child.end_time_unix_nano <= root.end_time_unix_nano
    attrs = _attributes(root)
    assert attrs["fleetgate.tenant"] == "acme" and attrs["fleetgate.model"] == "digits"
    assert attrs["fleetgate.deployment"] == "ort" and attrs["fleetgate.protocol"] == "v2"
    assert _attributes(by_name["admit"])["fleetgate.cost"] == 1  # an int stays an int
    assert root.status.code == Status.STATUS_CODE_UNSET
    # the refused request: a trace of its own, its root span failed with the error's type
    (failed,) = [s for s in spans if s.name == "fleetgate.request" and s.trace_id.hex() != TRACE_ID]
    assert failed.status.code == Status.STATUS_CODE_ERROR and failed.status.message == "InvalidInput"
    assert failed.parent_span_id == b"" and failed.flags == 0x101
    everything = b"".join(_Collector.bodies)
    assert key.encode() not in everything and key[:12].encode() not in everything


def test_every_attribute_type_survives_the_encoding() -> None:
    sent: list[tracing.Span] = []
    tracing.enable(sent.append)
    try:
        parent = tracing.RemoteParent(int(TRACE_ID, 16), int(CLIENT_SPAN, 16), True, "vendor=a1,other=b2")
        with tracing.span("fleetgate.request", parent, text="naïve ✓", count=-3, big=2**40, ratio=0.25) as root:
            root.set_attributes({"flag": True, "off": False, "dropped": None})
            with pytest.raises(ValueError), tracing.child("backend", deployment="d"):
                raise ValueError("the message may quote input: never exported")
    finally:
        tracing.disable()
    encoder = SpanEncoder({"service.name": "svc", "replica": 3})
    message = ExportTraceServiceRequest.FromString(encoder.request([encoder.span(s) for s in sent]))
    (resource_spans,) = message.resource_spans
    assert {a.key: a.value for a in resource_spans.resource.attributes}["replica"].int_value == 3
    child, root_proto = resource_spans.scope_spans[0].spans
    assert _attributes(root_proto) == {
        "text": "naïve ✓", "count": -3, "big": 2**40, "ratio": 0.25, "flag": True, "off": False,
    }  # fmt: skip
    assert root_proto.trace_state == "vendor=a1,other=b2" and child.trace_state == "vendor=a1,other=b2"
    assert child.status.code == Status.STATUS_CODE_ERROR and child.status.message == "ValueError"
    assert _attributes(child) == {"deployment": "d", "error.type": "ValueError"}
    assert b"never exported" not in encoder.span(sent[0])
    assert child.span_id == sent[0].span_id.to_bytes(8, "big") and child.trace_id.hex() == TRACE_ID


def test_values_that_hash_alike_keep_their_types_through_the_attribute_cache() -> None:
    """1, True and 1.0 are equal as dict keys; the encoder's cache must not answer one for another,
    in whichever order they come, and repeats (served from the cache) decode the same."""
    sent: list[tracing.Span] = []
    tracing.enable(sent.append)
    try:
        for value in (1, True, 1.0, 1, True, 1.0, 5000, 5000, "1", "1"):
            with tracing.span("fleetgate.request", v=value):
                pass
    finally:
        tracing.disable()
    encoder = SpanEncoder({"service.name": "svc"})
    message = ExportTraceServiceRequest.FromString(encoder.request([encoder.span(s) for s in sent]))
    got = [span.attributes[0].value for span in message.resource_spans[0].scope_spans[0].spans]
    kinds = [(value.WhichOneof("value"), getattr(value, value.WhichOneof("value"))) for value in got]
    assert kinds == [
        ("int_value", 1), ("bool_value", True), ("double_value", 1.0),
        ("int_value", 1), ("bool_value", True), ("double_value", 1.0),
        ("int_value", 5000), ("int_value", 5000), ("string_value", "1"), ("string_value", "1"),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "header",
    [
        "garbage",
        f"00-{TRACE_ID}-{CLIENT_SPAN}",  # a field missing
        f"ff-{TRACE_ID}-{CLIENT_SPAN}-01",  # version ff is forbidden
        f"00-{'0' * 32}-{CLIENT_SPAN}-01",  # all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE_ID.upper()}-{CLIENT_SPAN}-01",  # hex is lowercase
        f"00-{TRACE_ID}-{CLIENT_SPAN}-01-extra",  # version 00 has exactly four fields
    ],
)
def test_an_invalid_traceparent_starts_a_new_trace(header: str) -> None:
    tracing.enable(lambda span: None)
    try:
        assert tracing.extract_context({"traceparent": header}) is None
    finally:
        tracing.disable()


def test_traceparent_rules_and_parent_based_sampling() -> None:
    sent: list[tracing.Span] = []
    tracing.enable(sent.append, sample_ratio=0.0)
    try:
        # a later version's header is read by its first four fields; tracestate travels with it
        later = tracing.extract_context(
            {"traceparent": f"01-{TRACE_ID}-{CLIENT_SPAN}-01-more", "tracestate": "k=v"}
        )
        assert later == tracing.RemoteParent(int(TRACE_ID, 16), int(CLIENT_SPAN, 16), True, "k=v")
        too_long = tracing.extract_context(
            {"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01", "tracestate": "k=" + "v" * 600}
        )
        assert too_long is not None and too_long.tracestate == ""
        # the client's decision wins over sample_ratio 0: recorded, children too, passed on
        with tracing.span("fleetgate.request", later), tracing.child("backend"):
            headers = tracing.trace_headers()
        assert [s.name for s in sent] == ["backend", "fleetgate.request"]
        assert headers["traceparent"] == f"00-{TRACE_ID}-{sent[0].span_id:016x}-01"
        assert headers["tracestate"] == "k=v"
        # not sampled (ratio 0, no client): nothing recorded, the decision still passed on
        sent.clear()
        with tracing.span("fleetgate.request") as root, tracing.child("backend") as child:
            assert child is None and not root.is_recording()
            unsampled = tracing.trace_headers()["traceparent"]
        assert sent == [] and unsampled.endswith("-00") and unsampled.split("-")[1] == f"{root.trace_id:032x}"
        # a client that did not sample is followed even at ratio 1
        tracing.enable(sent.append, sample_ratio=1.0)
        declined = tracing.extract_context({"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-00"})
        with tracing.span("fleetgate.request", declined):
            assert tracing.trace_headers()["traceparent"].startswith(f"00-{TRACE_ID}-")
        assert sent == []
        # without a client decision, sample_ratio keeps about that fraction of traces
        tracing.enable(sent.append, sample_ratio=0.25)
        for _ in range(4000):
            with tracing.span("fleetgate.request"):
                pass
        assert 800 <= len(sent) <= 1200
    finally:
        tracing.disable()
    assert tracing.span("fleetgate.request") is tracing.child("x")  # off: one shared no-op, no allocation


def test_a_collector_that_is_down_costs_dropped_spans_and_a_warning_never_an_error() -> None:
    sent: list[tracing.Span] = []
    tracing.enable(sent.append)
    try:
        for _ in range(15):
            with tracing.span("fleetgate.request"):
                pass
    finally:
        tracing.disable()
    down = OtlpHttpSender(f"http://127.0.0.1:{free_port()}/v1/traces", timeout_s=2)
    export = BatchSpanExport(SpanEncoder({"service.name": "svc"}), down, interval_s=60, max_queued=10)
    for span in sent:
        export.add(span)  # the first 10 queue; the queue is full for the last 5
    assert export.dropped == 5
    with structlog.testing.capture_logs() as logs:
        export.close()  # sends the 10 queued: refused, dropped, logged once
    assert export.dropped == 15 and export.sent == 0
    assert [e["event"] for e in logs] == ["trace_export_failed"] and logs[0]["spans_dropped"] == 15
    assert not export._thread.is_alive()


def test_an_otlp_endpoint_must_be_http() -> None:
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match="otlp_endpoint"):
        parse_config("tracing: {enabled: true, otlp_endpoint: 'grpc://collector:4317'}", base_dir=Path("."))


def test_a_reload_turns_tracing_on_and_off_and_changes_sampling(tmp_path, digits, collector: str) -> None:  # noqa: ANN001
    path = tmp_path / "gw.yaml"

    def write(tracing_section: str) -> None:
        path.write_text(
            f"""
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments: {{ort: {{backend: onnxruntime, model: {digits.onnx_path}}}}}
models: {{digits: {{routes: [{{deployment: ort}}]}}}}
tracing: {{otlp_endpoint: "{collector}", {tracing_section}}}
"""
        )

    row = digits_split()[1][0].tolist()
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": row}]}

    def roots(service: str) -> set[str]:
        """Trace ids of the request spans the collector holds from `service`."""
        return {
            s.trace_id.hex()
            for resource, s in _received()
            if s.name == "fleetgate.request" and resource["service.name"] == service
        }

    write("enabled: false")
    with serve_app(create_app(load_config(path), config_path=path)) as url:
        key = create_key(url, "acme")

        def infer(trace_id: str | None = None) -> None:
            headers = {"Authorization": f"Bearer {key}"}
            if trace_id is not None:
                headers["traceparent"] = f"00-{trace_id}-{CLIENT_SPAN}-01"
            assert httpx.post(f"{url}/v2/models/digits/infer", json=body, headers=headers).status_code == 200

        def reload(tracing_section: str) -> None:
            write(tracing_section)
            assert httpx.post(f"{url}/admin/reload", headers=ADMIN).status_code == 200

        infer("1" * 32)  # off: nothing traced
        reload("enabled: true, service_name: first")
        infer("2" * 32)
        reload("enabled: true, service_name: first, sample_ratio: 0.0")  # the same exporter
        infer()  # not sampled: no trace decided by the client, ratio 0
        infer("3" * 32)  # the client's decision to sample still holds (parent-based)
        reload("enabled: false")  # the exporter is closed: what it held is sent before the answer
        assert roots("first") == {"2" * 32, "3" * 32}
        infer("4" * 32)
        reload("enabled: true, service_name: second")  # another destination: a new exporter
        infer("5" * 32)
    assert roots("second") == {"5" * 32}  # sent at shutdown
    assert roots("first") == {"2" * 32, "3" * 32}
