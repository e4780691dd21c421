"""Traces as a collector receives them: the SDK's OTLP/HTTP exporter sending protobuf to a collector
on loopback, decoded with the `opentelemetry-proto` classes; the W3C `traceparent` in and out; the
standard `OTEL_*` variables filling in what the config leaves unset; sampling rules; a collector that
is down; tracing changed by a config reload."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto
from opentelemetry.proto.trace.v1.trace_pb2 import Status
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from backends.demo_models.digits import digits_split
from fleetgate import tracing
from gateway.config import TracingConfig, load_config, parse_config
from gateway.http.app import create_app
from gateway.observe.telemetry import TracingSwitch, protocol_of
from tests import openai_upstream
from tests.conftest import ADMIN_KEY, create_key
from tests.servers import free_port, serve_app

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


class _Collector(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    bodies: list[bytes] = []
    headers_seen: list[dict[str, str]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        assert self.path == "/v1/traces" and self.headers["content-type"] == "application/x-protobuf"
        type(self).headers_seen.append(dict(self.headers))
        type(self).bodies.append(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def collector() -> Iterator[str]:
    """An OTLP/HTTP collector on loopback; yields its base URL (the traces path is /v1/traces)."""
    _Collector.bodies, _Collector.headers_seen = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(autouse=True)
def _no_otel_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tests start from a clean environment: an OTEL_* variable of the machine must not leak in."""
    import os

    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    yield
    tracing.disable()


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


def test_a_configured_gateway_sends_its_traces_to_the_collector(digits, upstream_url: str, collector: str) -> None:  # noqa: ANN001
    config = parse_config(
        f"""
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments:
  ort: {{backend: onnxruntime, model: {digits.onnx_path}}}
  up: {{backend: remote, url: {upstream_url}, protocol: openai, model_name: echo-upstream, api_key_env: TEST_UPSTREAM_KEY}}
models:
  digits: {{routes: [{{deployment: ort}}]}}
  echo: {{routes: [{{deployment: up}}]}}
tracing: {{enabled: true, service_name: edge-gw, otlp_endpoint: "{collector}/v1/traces", headers: {{x-collector-key: c1}}}}
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
        client = OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, default_headers=headers)
        client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "secret prompt"}])
        sent_upstream = openai_upstream.RECEIVED_HEADERS[-1]["traceparent"]
    # the app has stopped: what was queued has been sent, with the configured headers
    assert _Collector.headers_seen and all(h["x-collector-key"] == "c1" for h in _Collector.headers_seen)
    received = _received()
    assert received and all(resource["service.name"] == "edge-gw" for resource, _ in received)
    spans = [s for _, s in received]
    continued = [s for s in spans if s.trace_id.hex() == TRACE_ID]
    # the tensor request: its root span and its one backend attempt (no step spans by default)
    roots = [s for s in continued if s.name == "fleetgate.request"]
    tensor_root = next(s for s in roots if _attributes(s)["fleetgate.protocol"] == "v2")
    (backend,) = [s for s in continued if s.name == "backend" and s.parent_span_id == tensor_root.span_id]
    assert {s.name for s in continued} == {"fleetgate.request", "backend", "backend.first_token"}
    assert tensor_root.parent_span_id.hex() == CLIENT_SPAN and tensor_root.kind == SpanProto.SPAN_KIND_SERVER
    assert backend.kind == SpanProto.SPAN_KIND_INTERNAL
    assert tensor_root.start_time_unix_nano <= backend.start_time_unix_nano <= backend.end_time_unix_nano
    assert backend.end_time_unix_nano <= tensor_root.end_time_unix_nano
    attrs = _attributes(tensor_root)
    assert attrs["fleetgate.tenant"] == "acme" and attrs["fleetgate.model"] == "digits"
    assert attrs["fleetgate.deployment"] == "ort" and attrs["fleetgate.protocol"] == "v2"
    assert tensor_root.status.code == Status.STATUS_CODE_UNSET
    # out: the upstream was called inside the generation's attempt span, in the client's trace
    (attempt,) = [s for s in continued if s.name == "backend.first_token"]
    assert sent_upstream == f"00-{TRACE_ID}-{attempt.span_id.hex()}-01"
    # the refused request: a trace of its own, its root span failed with the error's type
    (failed,) = [s for s in spans if s.name == "fleetgate.request" and s.trace_id.hex() != TRACE_ID]
    assert failed.status.code == Status.STATUS_CODE_ERROR and failed.status.message == "InvalidInput"
    assert failed.parent_span_id == b"" and _attributes(failed)["error.type"] == "InvalidInput"
    everything = b"".join(_Collector.bodies)
    assert key.encode() not in everything and key[:12].encode() not in everything
    assert b"secret prompt" not in everything


def test_otel_variables_fill_in_what_the_config_leaves_unset(
    collector: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector)  # the exporter adds /v1/traces
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-collector-key=from-env")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    switch = TracingSwitch(TracingConfig(enabled=True))
    with tracing.span("fleetgate.request"):  # ratio 0 from the environment: not kept
        pass
    client = tracing.extract_context({"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
    with tracing.span("fleetgate.request", client):  # the client's decision (parent-based)
        pass
    switch.provider.shutdown()
    ((resource, span),) = _received()
    assert resource["service.name"] == "from-env" and span.trace_id.hex() == TRACE_ID
    assert _Collector.headers_seen[0]["x-collector-key"] == "from-env"


def test_the_config_wins_over_otel_variables(collector: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{free_port()}/v1/traces")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")  # not spoken here; the config's is
    config = TracingConfig(
        enabled=True,
        otlp_endpoint=f"{collector}/v1/traces",
        service_name="from-config",
        sample_ratio=1.0,
        protocol="http/protobuf",
    )
    switch = TracingSwitch(config)
    with tracing.span("fleetgate.request"):
        pass
    switch.provider.shutdown()
    ((resource, _),) = _received()
    assert resource["service.name"] == "from-config"


def test_protocol_grpc_sends_to_an_otlp_grpc_collector() -> None:
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[ExportTraceServiceRequest] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: ANN001, ANN202, N802 - the service's names
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        config = TracingConfig(enabled=True, protocol="grpc", otlp_endpoint=f"http://127.0.0.1:{port}")
        switch = TracingSwitch(config)
        client = tracing.extract_context({"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-01"})
        with tracing.span("fleetgate.request", client):
            pass
        switch.provider.shutdown()
    finally:
        server.stop(None)
    ((span,),) = [[s for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans] for r in received]
    assert span.name == "fleetgate.request" and span.trace_id.hex() == TRACE_ID


def test_the_protocol_comes_from_the_config_then_the_variables() -> None:
    assert protocol_of(TracingConfig(), {}) == "http/protobuf"
    assert protocol_of(TracingConfig(), {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}) == "grpc"
    both = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    assert protocol_of(TracingConfig(), both) == "http/protobuf"  # the traces-specific one first
    assert protocol_of(TracingConfig(protocol="grpc"), both) == "grpc"  # the config first
    with pytest.raises(ValueError, match="OTLP protocol 'http/json' is not supported"):
        protocol_of(TracingConfig(), {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_a_reload_to_a_protocol_not_spoken_is_refused_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from gateway.config import ConfigError

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    switch = TracingSwitch(TracingConfig())
    with pytest.raises(ConfigError, match="OTLP protocol 'http/json' is not supported"):
        asyncio.run(switch.reconfigure(TracingConfig(enabled=True)))
    assert switch.config == TracingConfig() and switch.provider is None and not tracing.enabled()


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
    TracingSwitch(TracingConfig(), InMemorySpanExporter())
    assert tracing.extract_context({"traceparent": header}) is None


def test_traceparent_rules_parent_based_sampling_and_attributes() -> None:
    exporter = InMemorySpanExporter()
    TracingSwitch(TracingConfig(sample_ratio=0.0), exporter)
    # a later version's header is read by its first four fields; tracestate travels with it
    later = tracing.extract_context({"traceparent": f"01-{TRACE_ID}-{CLIENT_SPAN}-01-more", "tracestate": "k=v"})
    assert later is not None
    # the client's decision wins over sample_ratio 0: recorded, children too, passed on
    with tracing.span("fleetgate.request", later, text="naïve ✓", count=-3, ratio=0.25, dropped=None) as root:
        root.set_attributes({"flag": True, "none": None})
        with pytest.raises(ValueError), tracing.child("backend", deployment="d"):
            headers = tracing.trace_headers()
            raise ValueError("the message may quote input: never exported")
    child, root_span = exporter.get_finished_spans()
    assert headers == {"traceparent": f"00-{TRACE_ID}-{child.context.span_id:016x}-01", "tracestate": "k=v"}
    assert dict(root_span.attributes) == {"text": "naïve ✓", "count": -3, "ratio": 0.25, "flag": True}
    assert child.status.status_code.name == "ERROR" and child.status.description == "ValueError"
    assert dict(child.attributes) == {"deployment": "d", "error.type": "ValueError"} and not child.events
    # not sampled (ratio 0, no client): nothing recorded, the decision still passed on
    exporter.clear()
    with tracing.span("fleetgate.request") as root, tracing.child("backend") as child_span:
        assert child_span is None and not root.is_recording()
        unsampled = tracing.trace_headers()["traceparent"]
    assert list(exporter.get_finished_spans()) == []
    _, trace_id, _, flags = unsampled.split("-")
    assert trace_id == f"{root.trace_id:032x}" and int(flags, 16) & 1 == 0  # the sampled bit off
    # a client that did not sample is followed even at ratio 1
    TracingSwitch(TracingConfig(sample_ratio=1.0), exporter)
    declined = tracing.extract_context({"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN}-00"})
    with tracing.span("fleetgate.request", declined):
        assert tracing.trace_headers()["traceparent"].startswith(f"00-{TRACE_ID}-")
    assert list(exporter.get_finished_spans()) == []
    # without a client decision, sample_ratio keeps about that fraction of traces
    TracingSwitch(TracingConfig(sample_ratio=0.25), exporter)
    for _ in range(4000):
        with tracing.span("fleetgate.request"):
            pass
    assert 800 <= len(exporter.get_finished_spans()) <= 1200


def test_a_collector_that_is_down_never_fails_a_request_or_the_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")  # the exporter gives up after 1 s
    down = f"http://127.0.0.1:{free_port()}/v1/traces"
    switch = TracingSwitch(TracingConfig(enabled=True, otlp_endpoint=down, max_queued_spans=10, export_batch_size=5))
    for _ in range(15):
        with tracing.span("fleetgate.request"):  # past the queue's 10: dropped, not held
            pass
    started = time.monotonic()
    switch.provider.shutdown()  # sends what is queued: refused, dropped, logged by the SDK
    assert time.monotonic() - started < 10


def test_a_reload_turns_tracing_on_and_off_and_changes_sampling(tmp_path, digits, collector: str) -> None:  # noqa: ANN001
    path = tmp_path / "gw.yaml"

    def write(tracing_section: str) -> None:
        path.write_text(
            f"""
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments: {{ort: {{backend: onnxruntime, model: {digits.onnx_path}}}}}
models: {{digits: {{routes: [{{deployment: ort}}]}}}}
tracing: {{otlp_endpoint: "{collector}/v1/traces", {tracing_section}}}
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
        reload("enabled: true, service_name: first, sample_ratio: 0.0")  # the same processor
        infer()  # not sampled: no trace decided by the client, ratio 0
        infer("3" * 32)  # the client's decision to sample still holds (parent-based)
        reload("enabled: false")  # the provider is shut down: what it held is sent before the answer
        assert roots("first") == {"2" * 32, "3" * 32}
        infer("4" * 32)
        reload("enabled: true, service_name: second")  # another destination: a new processor
        infer("5" * 32)
    assert roots("second") == {"5" * 32}  # sent at shutdown
    assert roots("first") == {"2" * 32, "3" * 32}
