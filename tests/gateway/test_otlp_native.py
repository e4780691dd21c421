"""The C span encoder (`fleetgate/otlp_native.c`): built here, the same bytes as the Python encoder
for every kind of span and attribute, and a gateway that cannot build it keeps the Python one."""

from __future__ import annotations

import gc
import math
import shutil
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from fleetgate import otlp_native, tracing
from fleetgate.otlp import SpanEncoder

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736


@pytest.fixture
def fresh_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`load()` builds again, into an empty cache directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    otlp_native.load.cache_clear()
    yield
    otlp_native.load.cache_clear()


@pytest.fixture(scope="module")
def native():  # noqa: ANN201
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the gateway uses the Python encoder (tested below)")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        pytest.skip("no Python headers here: the gateway uses the Python encoder (tested below)")
    module = otlp_native.load()
    assert module is not None, "a C compiler is installed but the encoder did not build"
    return module


def _spans() -> list[tracing.Span]:
    """Spans covering what the encoder meets: a root with a remote parent and tracestate, children,
    every attribute type, a failure, a value over the encoder's 1 KiB inline buffer."""
    sent: list[tracing.Span] = []
    tracing.enable(sent.append)
    try:
        parent = tracing.RemoteParent(TRACE_ID, 0x00F067AA0BA902B7, True, "vendor=a1,other=b2")
        attributes = {
            "text": "naïve ✓ 日本",
            "empty": "",
            "zero": 0,
            "negative": -3,
            "big": 2**40,
            "huge": 2**70 + 5,  # beyond int64: both keep the low 64 bits
            "min": -(2**63),
            "ratio": 0.25,
            "nan": math.nan,
            "flag": True,
            "off": False,
            "dropped": None,
            "path": Path("/models/a"),  # sent as its str()
            "long": "x" * 5000,
        }
        with tracing.span("fleetgate.request", parent, **attributes) as root:
            with tracing.child("authenticate"):
                pass
            with tracing.child("admit", **{"fleetgate.cost": 1}):
                pass
            with pytest.raises(ValueError), tracing.child("backend", deployment="d"):
                raise ValueError("never exported")
            root.set_attribute("http.status_code", 200)
        with tracing.span("fleetgate.request", None, **{"fleetgate.tenant": "t"}) as fresh:
            fresh.fail(KeyError("k"))
    finally:
        tracing.disable()
    return sent


def test_the_c_encoder_writes_the_python_encoders_bytes(native) -> None:  # noqa: ANN001
    spans = _spans()
    python = SpanEncoder({"service.name": "svc"})
    c = SpanEncoder({"service.name": "svc"}, native=native)
    assert c.span is native.encode_span
    for span in spans:
        assert c.span(span) == python.python_span(span), span.name
    # and a collector decodes them: every span, the status of the failed ones
    message = ExportTraceServiceRequest.FromString(c.request([c.span(s) for s in spans]))
    decoded = message.resource_spans[0].scope_spans[0].spans
    assert [s.name for s in decoded] == [s.name for s in spans]
    failed = [s for s in decoded if s.status.code == 2]
    assert sorted(s.status.message for s in failed) == ["KeyError", "ValueError"]
    continued = [s for s in decoded if s.trace_id == TRACE_ID.to_bytes(16, "big")]
    root = next(s for s in continued if s.name == "fleetgate.request")
    assert root.flags == 0x301  # sampled, and the parent is the client's span
    assert all(s.flags == 0x101 and s.parent_span_id == root.span_id for s in continued if s is not root)


def test_the_c_encoder_refuses_what_is_not_a_span(native) -> None:  # noqa: ANN001
    (span, *_) = _spans()
    span.attributes = ["not", "a", "dict"]
    with pytest.raises(TypeError, match="dict"):
        native.encode_span(span)
    span.attributes = {1: "a non-str key"}
    with pytest.raises(TypeError, match="keys must be str"):
        native.encode_span(span)
    with pytest.raises(AttributeError):
        native.encode_span(object())


def test_without_a_compiler_the_python_encoder_serves(fresh_build, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("CC", "/nonexistent/cc")  # failure injection: the compiler cannot run
    with structlog.testing.capture_logs() as logs:
        assert otlp_native.load() is None
    (warning,) = [e for e in logs if e["event"] == "otlp_native_encoder_unavailable"]
    assert "nonexistent" in warning["reason"]
    encoder = SpanEncoder({"service.name": "svc"}, native=otlp_native.load())
    assert encoder.span == encoder.python_span


def test_it_can_be_turned_off(fresh_build, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("FLEETGATE_OTLP_NATIVE", "0")
    with structlog.testing.capture_logs() as logs:
        assert otlp_native.load() is None
    assert [e["event"] for e in logs] == ["otlp_native_encoder_off"]


def test_a_fresh_cache_builds_it_once_and_reuses_it(fresh_build, tmp_path: Path, native) -> None:  # noqa: ANN001
    first = otlp_native.load()
    assert first is not None
    (library,) = (tmp_path / "fleetgate").glob("fleetgate_otlp_*")
    built_at = library.stat().st_mtime_ns
    otlp_native.load.cache_clear()
    assert otlp_native.load() is not None
    assert library.stat().st_mtime_ns == built_at  # loaded from the cache, not rebuilt
    assert not list((tmp_path / "fleetgate").glob("*.tmp"))  # no half-written file left


def test_a_value_that_changes_the_attributes_while_encoded_is_refused(native) -> None:  # noqa: ANN001
    (span, *_) = _spans()

    class Clearing:  # str() runs Python code that empties the dict being encoded
        def __str__(self) -> str:
            span.attributes.clear()
            return "gone"

    span.attributes = {"first-" + "key": Clearing(), "second": "x"}
    with pytest.raises(RuntimeError, match="changed size"):
        native.encode_span(span)


def test_a_span_that_cannot_be_encoded_is_dropped_not_raised(native) -> None:  # noqa: ANN001
    from fleetgate.span_export import BatchSpanExport

    class NullSender:
        def send(self, body: bytes) -> None:
            pass

        def close(self) -> None:
            pass

    export = BatchSpanExport(SpanEncoder({"service.name": "svc"}, native=native), NullSender())
    try:
        (span, *_) = _spans()
        span.attributes = {1: "a non-str key"}
        with structlog.testing.capture_logs() as logs:
            export.add(span)  # on the request's path: must not raise
        assert export.dropped == 1
        assert [e["event"] for e in logs] == ["trace_span_unencodable"]
    finally:
        export.close()


def test_a_cached_library_that_does_not_load_is_built_again(fresh_build, native) -> None:  # noqa: ANN001
    _, library = otlp_native.library_path()
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")  # failure injection: a file cut short by a crash
    assert otlp_native.load() is not None
    assert library.stat().st_size > 0 and library.stat().st_mode & 0o044 == 0o044  # others may load it


# --- the C span type (`fleetgate/span_native.h`) --------------------------------------------------


def _observed(native: object) -> list[tuple]:  # noqa: ANN001
    """What a span exposes after the operations the gateway performs, with `native` spans or (None)
    Python ones; span ids become their span's position in the list, so two runs compare."""
    sent: list = []
    tracing.enable(sent.append, native=native)
    try:
        parent = tracing.RemoteParent(TRACE_ID, 0x00F067AA0BA902B7, True, "vendor=a1")
        with tracing.span("fleetgate.request", parent, **{"fleetgate.protocol": "v2"}) as root:
            assert tracing.trace_headers() == {"traceparent": root.traceparent, "tracestate": "vendor=a1"}
            with tracing.child("backend", deployment="d") as backend:
                backend.set_attribute("status", 200)
                backend.set_attributes({"rows": 3, "ratio": 0.5})
                assert tracing.trace_headers()["traceparent"] == backend.traceparent
                assert backend.is_recording() and not backend.remote_parent
            with pytest.raises(KeyError), tracing.child("fails"):
                raise KeyError("never exported")
            root.fail(ValueError("nor this"))
        root.end()  # ended already: nothing more is sent
        started = tracing.start_span("fleetgate.request", None, protocol="openai")
        with tracing.current(started):
            with tracing.child("queue"):
                pass
        started.end()
        assert not started.is_recording()
    finally:
        tracing.disable()
    position = {span.span_id: i for i, span in enumerate(sent)}
    position[0x00F067AA0BA902B7] = "client"
    position[0] = None
    return [
        (
            s.name, type(s.trace_id), s.trace_id == TRACE_ID, position[s.span_id], position[s.parent_id],
            s.kind, s.recording, s.remote_parent, s.error, s.attributes, s.tracestate,
            0 < s.start_ns <= s.end_ns, s.is_recording(),
            s.traceparent == f"00-{s.trace_id:032x}-{s.span_id:016x}-01",
        )
        for s in sent
    ]  # fmt: skip


def test_c_spans_behave_as_python_spans(native) -> None:  # noqa: ANN001
    c = _observed(native)
    assert c == _observed(None)
    assert [row[0] for row in c] == ["backend", "fails", "fleetgate.request", "queue", "fleetgate.request"]
    assert c[1][8] == "KeyError" and c[2][8] == "ValueError"  # the error's type, never its message


def test_c_spans_of_an_unsampled_trace_record_nothing_and_pass_the_decision_on(native) -> None:  # noqa: ANN001
    sent: list = []
    tracing.enable(sent.append, sample_ratio=0.0, native=native)
    try:
        with (
            tracing.span("fleetgate.request", None, protocol="v2") as root,
            tracing.child("backend") as child,
        ):
            assert child is None and isinstance(root, native.Span) and not root.is_recording()
            root.set_attribute("ignored", 1)
            assert root.attributes == {} and tracing.trace_headers()["traceparent"].endswith("-00")
    finally:
        tracing.disable()
    assert sent == []
    assert tracing.span("fleetgate.request") is tracing.child("x")  # off again: the shared no-op


class _NullSender:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def send(self, body: bytes) -> None:
        self.bodies.append(body)

    def close(self) -> None:
        pass


def test_c_spans_queue_the_encoders_bytes_themselves(native) -> None:  # noqa: ANN001
    from fleetgate.span_export import BatchSpanExport

    encoder = SpanEncoder({"service.name": "svc"}, native=native)
    export = BatchSpanExport(encoder, _NullSender(), interval_s=60, batch_size=3, max_queued=4)
    tracing.enable(export.add, native=native, queue=export.native_queue())
    try:
        spans = []
        parent = tracing.RemoteParent(TRACE_ID, 0x00F067AA0BA902B7, True, "vendor=a1")
        with tracing.span("fleetgate.request", parent, text="naïve ✓", big=2**70, flag=True) as root:
            with tracing.child("backend", deployment="d") as child:
                spans.append(child)
            assert list(export._queued) == [native.encode_span(child)] == [encoder.python_span(child)]
        spans.append(root)
        assert export._queued[-1] == encoder.python_span(root)
    finally:
        tracing.disable()
    export.close()
    (body,) = export._sender.bodies
    decoded = ExportTraceServiceRequest.FromString(body).resource_spans[0].scope_spans[0].spans
    assert [s.name for s in decoded] == ["backend", "fleetgate.request"]
    assert decoded[0].parent_span_id == decoded[1].span_id and decoded[1].flags == 0x301


def test_a_full_queue_and_an_unencodable_c_span_are_counted_never_raised(native) -> None:  # noqa: ANN001
    from fleetgate.span_export import BatchSpanExport

    sender = _NullSender()
    export = BatchSpanExport(
        SpanEncoder({"service.name": "svc"}), sender, interval_s=60, batch_size=2, max_queued=3
    )
    tracing.enable(export.add, native=native, queue=export.native_queue())
    try:
        with structlog.testing.capture_logs() as logs:
            with tracing.span("fleetgate.request") as bad:
                bad.attributes = {1: "a non-str key"}  # failure injection: cannot be encoded
            for _ in range(5):  # the second wakes the exporter (batch size 2), which sends both
                with tracing.span("fleetgate.request"):
                    pass
    finally:
        tracing.disable()
    assert [e["event"] for e in logs] == ["trace_span_unencodable"]
    export.close()
    assert export.sent + export.dropped == 6 and export.dropped >= 1  # the bad one; others if full
    assert export.sent == sum(
        len(ExportTraceServiceRequest.FromString(b).resource_spans[0].scope_spans[0].spans)
        for b in sender.bodies
    )


def test_a_full_queue_drops_c_spans(native) -> None:  # noqa: ANN001
    from fleetgate.span_export import BatchSpanExport

    export = BatchSpanExport(
        SpanEncoder({"service.name": "svc"}), _NullSender(), interval_s=60, batch_size=10, max_queued=10
    )
    tracing.enable(export.add, native=native, queue=export.native_queue())
    try:
        for _ in range(15):
            with tracing.span("fleetgate.request"):
                pass
    finally:
        tracing.disable()
    assert len(export._queued) == 10 and export.dropped == 5
    export.close()
    assert export.sent == 10


def test_the_c_span_refuses_wrong_arguments(native) -> None:  # noqa: ANN001
    with pytest.raises(TypeError):
        native.Span("n", TRACE_ID, 0, True, ["not a dict"], 2, "")
    with pytest.raises(ValueError, match="kind"):
        native.Span("n", TRACE_ID, 0, True, {}, 999, "")
    span = native.Span("n", TRACE_ID, 0, True, {}, 2, "")
    with pytest.raises(TypeError, match="dict"):
        span.attributes = None
    with pytest.raises(TypeError):
        native.child(b"not a str")


def test_switching_tracing_while_a_c_span_is_encoded_is_safe(native) -> None:  # noqa: ANN001
    """str() of an attribute runs Python code as the span is encoded: turning tracing off there must
    not pull the exporter's queue from under the span (it crashed the process once)."""
    from fleetgate.span_export import BatchSpanExport

    export = BatchSpanExport(SpanEncoder({"service.name": "svc"}), _NullSender(), interval_s=60)

    class SwitchesTracingOff:
        def __str__(self) -> str:
            tracing.disable()
            gc.collect()
            return "value"

    tracing.enable(export.add, native=native, queue=export.native_queue())
    try:
        with tracing.span("fleetgate.request", None, odd=SwitchesTracingOff()):
            pass
    finally:
        tracing.disable()
    assert len(export._queued) == 1  # encoded and queued where it was headed
    export.close()


def test_c_span_attributes_replaced_by_python_code_midway_are_safe(native) -> None:  # noqa: ANN001
    span = native.Span("n", TRACE_ID, 0, True, {"a": 1}, 2, "")

    class ReplacesThem:  # hashing it replaces the dict the call is writing into
        def __hash__(self) -> int:
            span.attributes = {}
            return 1

    span.set_attribute(ReplacesThem(), 1)
    assert span.attributes == {}
    span.set_attributes([("pairs", 2)])  # whatever dict.update takes
    assert span.attributes == {"pairs": 2}


def test_a_c_span_cannot_be_entered_twice(native) -> None:  # noqa: ANN001
    tracing.enable(lambda span: None, native=native)
    try:
        with tracing.span("fleetgate.request") as root:
            with pytest.raises(RuntimeError, match="already current"), root:
                pass
            assert tracing.trace_headers()["traceparent"] == root.traceparent
    finally:
        tracing.disable()


def test_c_root_spans_sample_new_traces_by_the_ratio(native) -> None:  # noqa: ANN001
    sent: list = []
    for ratio, low, high in ((1.0, 2000, 2000), (0.5, 850, 1150), (1e-12, 0, 0)):
        sent.clear()
        tracing.enable(sent.append, sample_ratio=ratio, native=native)
        try:
            roots = [tracing.start_span("fleetgate.request", None, protocol="v2") for _ in range(2000)]
            for root in roots:
                root.end()
        finally:
            tracing.disable()
        assert low <= len(sent) <= high, (ratio, len(sent))
        assert len({s.trace_id for s in roots}) == 2000  # a new trace each, 128-bit ids
        assert all(s.attributes == {"protocol": "v2"} for s in sent)
        # the decision is the trace id's low 64 bits against the ratio, as the Python sampler's
        assert all(((s.trace_id & (2**64 - 1)) < round(ratio * 2**64)) == s.recording for s in roots)


def test_a_c_root_span_under_an_unsampled_client_trace_passes_the_decision_on(native) -> None:  # noqa: ANN001
    sent: list = []
    tracing.enable(sent.append, native=native)
    try:
        parent = tracing.RemoteParent(TRACE_ID, 0x00F067AA0BA902B7, False, "vendor=a1")
        with tracing.span("fleetgate.request", parent, protocol="v2") as root:
            assert isinstance(root, native.Span) and not root.is_recording()
            assert root.trace_id == TRACE_ID and root.parent_id == 0x00F067AA0BA902B7
            assert tracing.trace_headers() == {"traceparent": f"00-{TRACE_ID:032x}-{root.span_id:016x}-00",
                                               "tracestate": "vendor=a1"}  # fmt: skip
            assert tracing.child("backend") is tracing.child("queue")  # the shared no-op
    finally:
        tracing.disable()
    assert sent == []


def test_c_root_spans_refuse_wrong_arguments(native) -> None:  # noqa: ANN001
    tracing.enable(lambda span: None, native=native)
    try:
        with pytest.raises(TypeError, match="RemoteParent"):
            native.start_span("fleetgate.request", (1, 2))
        with pytest.raises(TypeError, match="name"):
            native.span(b"fleetgate.request")
        with pytest.raises(TypeError, match="tracestate"):
            native.start_span("fleetgate.request", (TRACE_ID, 7, True, None))
        with pytest.raises(ValueError, match="negative"):
            native.set_sample_bound(-1)
        with pytest.raises(TypeError):
            native.set_sample_bound(0.5)
    finally:
        tracing.disable()
    assert native.start_span("fleetgate.request") is None  # no sink: tracing is off


def test_c_root_spans_take_name_and_context_as_keywords(native) -> None:  # noqa: ANN001
    """`start_span(name, context=None, **attributes)` as the Python one binds it: a client's context
    passed by keyword was once an attribute, and the request started a new, sampled trace."""
    parent = tracing.RemoteParent(TRACE_ID, 0x00F067AA0BA902B7, False, "vendor=a1")
    tracing.enable(lambda span: None, native=native)
    try:
        for start, span in ((native.start_span, native.span), (tracing._python_start_span, tracing._python_span)):  # fmt: skip
            roots = [
                start(name="fleetgate.request", context=parent, protocol="v2"),
                span("fleetgate.request", context=parent, protocol="v2"),
            ]
            for root in roots:
                assert (root.name, root.trace_id, root.parent_id, root.recording, root.tracestate) == (
                    "fleetgate.request", TRACE_ID, 0x00F067AA0BA902B7, False, "vendor=a1")  # fmt: skip
                assert root.attributes == {"protocol": "v2"}
            assert start(name="fleetgate.request", protocol="v2").attributes == {"protocol": "v2"}
            for given in ({"name": "other"}, {"context": parent}):
                with pytest.raises(TypeError, match="multiple values"):
                    start("fleetgate.request", None, **given)
            with pytest.raises(TypeError):
                start(context=parent)  # no name
    finally:
        tracing.disable()


def test_a_negative_sample_ratio_with_c_spans_keeps_nothing_as_python_spans_do(native) -> None:  # noqa: ANN001
    """A bound below zero was refused by the C module after its sink had switched: `enable` raised,
    and C spans kept going to a sink that `disable` no longer knew of."""
    for module in (None, native):
        tracing.enable(lambda span: None, sample_ratio=-0.5, native=module)
        try:
            assert tracing.enabled() and not tracing.start_span("fleetgate.request").recording
        finally:
            tracing.disable()
    assert native.start_span("fleetgate.request") is None  # off in C too
