"""The gRPC port's own limits: a connection cap, a handshake deadline for sockets that never speak,
an idle timeout for connections with no call in flight, and a cap on calls in progress. A flood of
idle sockets used to stay open indefinitely, taking file descriptors the HTTP port shares."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc

from backends.demo_models.digits import digits_split
from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import create_key
from tests.servers import free_port, serve_app

pytestmark = pytest.mark.slow

CAP = 8
HANDSHAKE_S = 1.0
IDLE_S = 3.0
#: the client connection preface and an empty SETTINGS frame (RFC 9113 section 3.4)
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@dataclass
class Gateway:
    port: int
    target: str
    key: str


@pytest.fixture(scope="module")
def gw(digits) -> Iterator[Gateway]:  # noqa: ANN001
    port = free_port()
    text = f"""
server: {{grpc_port: {port}, grpc_max_connections: {CAP}, grpc_idle_timeout_s: {IDLE_S},
          header_timeout_s: {HANDSHAKE_S}, grpc_max_concurrent_rpcs: 1}}
state: {{url: "memory://"}}
tenants: {{acme: {{}}}}
deployments:
  ort: {{backend: onnxruntime, model: {digits.onnx_path}}}
models:
  digits: {{routes: [{{deployment: ort}}]}}
"""
    with serve_app(create_app(parse_config(text, base_dir=Path(".")))) as url:
        yield Gateway(port, f"127.0.0.1:{port}", create_key(url, "acme"))


def _closed(sock: socket.socket, within_s: float) -> bool:
    """True when the server closes `sock` within `within_s` (bytes it sends are read and dropped)."""
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(65536) == b"":
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
    return False


def _infer_ok(gw: Gateway) -> None:
    rows = digits_split()[1][:2].astype(np.float32)
    client = triton_grpc.InferenceServerClient(gw.target)
    try:
        inp = triton_grpc.InferInput("input", list(rows.shape), "FP32")
        inp.set_data_from_numpy(rows)
        result = client.infer("digits", [inp], headers={"authorization": f"Bearer {gw.key}"})
        assert result.as_numpy("label").shape == (2,)
    finally:
        client.close()


def test_connections_beyond_the_cap_are_closed_and_silent_ones_time_out(gw: Gateway) -> None:
    socks = [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(3 * CAP)]
    try:
        # the first CAP are taken (the server sends its SETTINGS); every one past the cap is closed
        time.sleep(0.3)
        closed = [_closed(s, 0.01) for s in socks]  # all looked at before the handshake deadline
        assert closed.count(False) == CAP and all(closed[CAP:]), closed
        # the ones within the cap never sent the HTTP/2 preface: closed after the handshake deadline
        assert all(_closed(s, HANDSHAKE_S + 3.0) for s in socks[:CAP])
    finally:
        for s in socks:
            s.close()
    _infer_ok(gw)  # the slots are free again for a real client


def _ack_pings_until_closed(sock: socket.socket, within_s: float) -> tuple[bool, bool]:
    """Speak just enough HTTP/2 (answer PINGs) for a graceful GOAWAY to finish: (goaway seen, closed)."""
    buffer, goaway = b"", False
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            return goaway, False
        except ConnectionResetError:
            return goaway, True
        if not data:
            return goaway, True
        buffer += data
        while len(buffer) >= 9:
            length = int.from_bytes(buffer[:3], "big")
            if len(buffer) < 9 + length:
                break
            kind, flags, payload = buffer[3], buffer[4], buffer[9 : 9 + length]
            buffer = buffer[9 + length :]
            goaway = goaway or kind == 0x7
            if kind == 0x6 and not flags & 0x1:  # PING without ACK: answer it
                sock.sendall(struct.pack(">I", 8)[1:] + b"\x06\x01\x00\x00\x00\x00" + payload)
    return goaway, False


def test_an_idle_connection_is_closed_after_the_idle_timeout(gw: Gateway) -> None:
    with socket.create_connection(("127.0.0.1", gw.port)) as sock:
        sock.sendall(PREFACE)
        started = time.monotonic()
        # past the handshake deadline it is still open: it spoke HTTP/2, it is just idle
        goaway, closed = _ack_pings_until_closed(sock, HANDSHAKE_S + 1.0)
        assert not closed and not goaway
        goaway, closed = _ack_pings_until_closed(sock, IDLE_S + 5.0)
        assert goaway and closed
        assert time.monotonic() - started >= IDLE_S - 0.5
    _infer_ok(gw)


def test_a_real_client_reconnects_after_its_idle_connection_closed(gw: Gateway) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(gw.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        assert stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        time.sleep(IDLE_S + 1.5)  # the server closes the idle connection meanwhile
        assert stub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING


def test_calls_beyond_the_concurrency_cap_are_resource_exhausted(gw: Gateway) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(gw.target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watch = stub.Watch(health_pb2.HealthCheckRequest())  # a stream that stays open: the one call
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Check(health_pb2.HealthCheckRequest())
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        watch.cancel()
    _infer_ok(gw)


@pytest.mark.parametrize(
    "field", ["grpc_max_connections: 0", "grpc_idle_timeout_s: 0", "grpc_idle_timeout_s: .inf", "grpc_max_concurrent_rpcs: 0"]
)
def test_the_limits_must_be_positive(field: str) -> None:
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match=field.split(":")[0]):
        parse_config(f"server: {{{field}}}\nstate: {{url: 'memory://'}}\n", base_dir=Path("."))
