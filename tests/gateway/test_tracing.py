"""OpenTelemetry traces through the SDK (the in-memory exporter a gateway is handed): one trace per
request, a root span and one per backend attempt (the gateway's step spans only with `step_spans`);
a client's `traceparent` continued and sent on to remote upstreams; tenant, model and deployment as
attributes, never the key."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from backends.demo_models.digits import digits_split
from fleetgate import tracing
from gateway.config import parse_config
from gateway.http.app import create_app
from tests import openai_upstream
from tests.conftest import create_key
from tests.servers import serve_app

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
STEPS = ("authenticate", "route", "admit", "queue")


@pytest.fixture(scope="module", params=[False, True], ids=["request-and-attempts", "step-spans"])
def traced(request, digits, upstream_url: str) -> Iterator[tuple[str, str, InMemorySpanExporter, bool]]:  # noqa: ANN001
    """A gateway exporting to the SDK's in-memory exporter, without and with step spans."""
    step_spans = request.param
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
tracing: {{step_spans: {str(step_spans).lower()}}}
""",
        base_dir=Path("."),
    )
    exporter = InMemorySpanExporter()
    with serve_app(create_app(config, span_exporter=exporter)) as url:
        yield url, create_key(url, "acme"), exporter, step_spans


def test_a_tensor_request_is_one_trace_continuing_the_clients(traced) -> None:  # noqa: ANN001
    url, key, exporter, step_spans = traced
    exporter.clear()
    row = digits_split()[1][0].tolist()
    body = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": row}]}
    headers = {"Authorization": f"Bearer {key}", "traceparent": TRACEPARENT}
    assert httpx.post(f"{url}/v2/models/digits/infer", json=body, headers=headers).status_code == 200
    finished = exporter.get_finished_spans()
    spans = {s.name: s for s in finished}
    # a root span and one per backend attempt; the steps only when asked for
    expected = {"fleetgate.request", "backend"} | (set(STEPS) if step_spans else set())
    assert sorted(s.name for s in finished) == sorted(expected)
    root = spans["fleetgate.request"]
    assert format(root.context.trace_id, "032x") == TRACE_ID  # the client's trace, continued
    assert root.parent.span_id == int(TRACEPARENT.split("-")[2], 16) and root.parent.is_remote
    assert all(s.context.trace_id == root.context.trace_id for s in finished)
    assert all(s.parent.span_id == root.context.span_id for s in finished if s is not root)
    attrs = dict(root.attributes)
    assert attrs["fleetgate.tenant"] == "acme" and attrs["fleetgate.model"] == "digits"
    assert attrs["fleetgate.deployment"] == "ort" and attrs["fleetgate.protocol"] == "v2"
    assert dict(spans["backend"].attributes)["fleetgate.backend"] == "onnxruntime"
    assert root.resource.attributes["service.name"] == "fleetgate"  # the default, no OTEL_SERVICE_NAME
    everything = " ".join(str(v) for s in finished for v in dict(s.attributes).values())
    assert key not in everything and key[:12] not in everything


def test_a_stream_is_traced_to_its_end_and_the_trace_goes_upstream(traced) -> None:  # noqa: ANN001
    url, key, exporter, _ = traced
    exporter.clear()
    client = OpenAI(
        base_url=f"{url}/v1", api_key=key, max_retries=0, default_headers={"traceparent": TRACEPARENT}
    )
    stream = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hello"}], max_tokens=4, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text
    (root,) = [s for s in exporter.get_finished_spans() if s.name == "fleetgate.request"]
    (attempt,) = [s for s in exporter.get_finished_spans() if s.name == "backend.first_token"]
    assert format(root.context.trace_id, "032x") == TRACE_ID
    attrs = dict(root.attributes)
    assert attrs["llm.completion_tokens"] >= 1 and attrs["llm.time_to_first_token_s"] > 0
    sent = openai_upstream.RECEIVED_HEADERS[-1]["traceparent"]
    # the upstream joins the same trace, under the attempt's span
    assert sent == f"00-{TRACE_ID}-{attempt.context.span_id:016x}-01"
    everything = " ".join(str(v) for s in exporter.get_finished_spans() for v in dict(s.attributes).values())
    assert "hello" not in everything  # never the prompt


def _authenticate_step_within_the_request(finished) -> None:  # noqa: ANN001
    """One `authenticate` span, a child of the request's span and inside its time."""
    (root,) = [s for s in finished if s.name == "fleetgate.request"]
    (step,) = [s for s in finished if s.name == "authenticate"]
    assert step.parent.span_id == root.context.span_id and step.context.trace_id == root.context.trace_id
    assert root.start_time <= step.start_time <= step.end_time <= root.end_time


def test_the_key_check_is_a_step_on_typed_and_untyped_routes(traced) -> None:  # noqa: ANN001
    """/v1/chat/completions checks the key in a guard, before the core opens the request's span;
    v2 infer checks it inside the span. Both traces show the `authenticate` step."""
    url, key, exporter, step_spans = traced
    headers = {"Authorization": f"Bearer {key}"}
    chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    row = digits_split()[1][0].tolist()
    infer = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": row}]}
    for path, body in (("/v1/chat/completions", chat), ("/v2/models/digits/infer", infer)):
        exporter.clear()
        assert httpx.post(f"{url}{path}", json=body, headers=headers).status_code == 200
        finished = exporter.get_finished_spans()
        if step_spans:
            assert set(STEPS) <= {s.name for s in finished}, path
            _authenticate_step_within_the_request(finished)
        else:
            assert not {s.name for s in finished} & set(STEPS), path


def test_tracing_is_off_by_default_and_free_while_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.config import TracingConfig
    from gateway.observe.telemetry import TracingSwitch

    config = parse_config("state: {url: 'memory://'}", base_dir=Path("."))
    assert config.tracing == TracingConfig() and config.tracing.enabled is False
    assert TracingSwitch(config.tracing).provider is None  # nothing set up
    monkeypatch.setattr(tracing, "_tracer", None)  # as in a process that never enabled it
    # one shared no-op for every span, nothing made
    assert tracing.span("fleetgate.request", None, x=1) is tracing.child("backend") is tracing.current(None)
    assert tracing.start_span("fleetgate.request") is None
    assert tracing.trace_headers() == {} and tracing.extract_context({"traceparent": TRACEPARENT}) is None


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("{sample_ratio: 1.5}", "sample_ratio must be in 0..1"),
        ("{otlp_endpoint: 'collector:4317'}", "otlp_endpoint must be an http:// or https:// URL"),
        ("{protocol: 'http/json'}", r"Invalid enum value 'http/json' \(expected one of: grpc, http/protobuf\) - at `\$.tracing.protocol`"),
        ("{export_interval_s: 0}", "export_interval_s must be > 0"),
        ("{export_batch_size: 50, max_queued_spans: 10}", "export_batch_size must be >= 1 and at most"),
    ],
)
def test_bad_tracing_settings_are_refused_with_the_field(section: str, message: str) -> None:
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_config(f"state: {{url: 'memory://'}}\ntracing: {section}", base_dir=Path("."))
