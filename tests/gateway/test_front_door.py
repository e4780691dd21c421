"""The front door under hostile clients, on a real `fleetgate serve` process (gateway/serve/http_protocol.py,
gateway/serve/health_listener.py): silent sockets from one address cannot fill the connection slots nor
fail the probes, and a forwarded-for header from a peer that is no configured proxy is not believed.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest

from gateway.config import ConfigError, parse_config
from tests.servers import free_port
from tests.tenancy.conftest import gateway_processes, write_config

# a second loopback address: 127.0.0.0/8 routes locally, so it reaches a listener on 127.0.0.1
OTHER_ADDRESS = "127.0.0.2"


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


def test_idle_sockets_from_one_address_are_capped_closed_early_and_leave_the_probes_answering(
    tmp_path: Path,
) -> None:
    """60 sockets from one address that never send a byte, against `max_connections: 40`: before
    the per-address cap they took every slot, and every request (probes included) got 503."""
    health_port = free_port()
    config = write_config(
        tmp_path / "gw.yaml",
        "server: {grpc_port: null, max_connections: 40, max_connections_per_client: 20,"
        f" first_byte_timeout_s: 2, header_timeout_s: 30, health_port: {health_port}}}\n"
        'state: {url: "memory://"}\n',
    )
    with gateway_processes([config], tmp_path) as (gw,):
        host, port = gw.url.removeprefix("http://").split(":")
        opened_at = time.monotonic()
        idle = [socket.create_connection((host, int(port)), timeout=15) for _ in range(60)]
        try:
            # a client from another address is served on the main port...
            with httpx.Client(transport=httpx.HTTPTransport(local_address=OTHER_ADDRESS)) as other:
                assert other.get(f"{gw.url}/health/live").status_code == 200
                assert other.get(f"{gw.url}/v2/health/ready").status_code == 200
            # ...and the probes' own port answers whatever the main port holds
            probes = f"http://127.0.0.1:{health_port}"
            assert httpx.get(f"{probes}/health/live").json() == {"status": "live"}
            assert httpx.get(f"{probes}/health/ready").json() == {"status": "ready"}
            assert httpx.get(f"{probes}/v2/health/live").json() == {"live": True}
            assert httpx.get(f"{probes}/v2/health/ready").json() == {"ready": True}
            assert httpx.get(f"{probes}/v1/models").status_code == 404  # probes only

            answers = [_read_all(s) for s in idle]
            closed_after_s = time.monotonic() - opened_at
        finally:
            for s in idle:
                s.close()
        over_cap = [a for a in answers if a.startswith(b"HTTP/1.1 503")]
        silent = [a for a in answers if a == b""]
        assert len(over_cap) == 40 and b"too many open connections" in over_cap[0]
        assert len(silent) == 20  # held until the first-byte deadline, then closed
        assert closed_after_s < 10  # at the 2 s first-byte deadline, not the 30 s header deadline
        # the address can connect again once its sockets are gone
        assert httpx.get(f"{gw.url}/health/live").status_code == 200


def test_forwarded_for_is_believed_only_from_a_configured_proxy(tmp_path: Path) -> None:
    """A loopback client rotating X-Forwarded-For used to escape the admin lockout (uvicorn trusts
    forwarded headers from 127.0.0.1 by default); a configured proxy's header is still believed."""
    base = "admin: {max_failures_per_minute: 3}\nstate: {url: \"memory://\"}\n"
    direct = write_config(tmp_path / "direct.yaml", "server: {grpc_port: null}\n" + base)
    proxied = write_config(
        tmp_path / "proxied.yaml", 'server: {grpc_port: null, trusted_proxies: ["127.0.0.0/8"]}\n' + base
    )
    with gateway_processes([direct, proxied], tmp_path) as (plain, behind_proxy):

        def attempts(url: str) -> list[int]:
            return [
                httpx.get(
                    f"{url}/admin/keys",
                    headers={"Authorization": "Bearer wrong", "X-Forwarded-For": f"203.0.113.{i}"},
                ).status_code
                for i in range(6)
            ]

        assert attempts(plain.url) == [401, 401, 401, 429, 429, 429]
        assert attempts(behind_proxy.url) == [401] * 6  # six clients behind the proxy, one failure each


@pytest.mark.parametrize(
    "server, message",
    [
        ("{health_port: 8000}", "health_port must differ from port and grpc_port"),
        ("{health_port: 8001}", "health_port must differ from port and grpc_port"),
        ("{health_port: 70000}", "health_port must be in 0..65535"),
        ("{trusted_proxies: [10.0.0.1/8]}", "'10.0.0.1/8' is not an address or a network"),
        ("{trusted_proxies: [proxy.local]}", "'proxy.local' is not an address or a network"),
        ("{first_byte_timeout_s: 0}", "first_byte_timeout_s must be a finite number > 0"),
        ("{max_connections_per_client: 0}", "max_connections_per_client must be >= 1"),
    ],
)
def test_front_door_settings_are_checked(tmp_path: Path, server: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(f"server: {server}\n", base_dir=tmp_path, env={})


def test_front_door_defaults(tmp_path: Path) -> None:
    server = parse_config(
        'server: {trusted_proxies: ["10.0.0.0/8", "::1", "*"]}\n', base_dir=tmp_path, env={}
    ).server
    assert server.trusted_proxies == ("10.0.0.0/8", "::1", "*")
    default = parse_config("", base_dir=tmp_path, env={}).server
    assert default.health_port is None and default.trusted_proxies == ()
    assert default.first_byte_timeout_s < default.header_timeout_s
    assert default.max_connections_per_client < default.max_connections
