"""The adapter admin route's typed body (gateway/admin/adapters.py): Litestar reads and decodes it
after the admin guard, under the request deadline, and every refusal answers in the admin envelope.

No LoRA deployment is needed: the body is refused (or accepted) before the handler looks for the
deployment, so an accepted body meets a 404 for the deployment `nope`."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from litestar import Litestar, Router

from gateway.admin.adapters import ROUTES as ADAPTER_ROUTES
from gateway.config import parse_config
from gateway.http.app import create_app
from gateway.http.requests import ADMIN_BODY_LIMIT, DEPENDENCIES
from tests.conftest import ADMIN_HEADERS
from tests.servers import serve_app

TIMEOUT_S = 1
LOAD = "/admin/deployments/nope/adapters"
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    config = parse_config(
        f'server: {{request_timeout_s: {TIMEOUT_S}}}\nstate: {{url: "memory://"}}\ntenants: {{t: {{}}}}\n',
        base_dir=Path("."),
    )
    with serve_app(create_app(config)) as served:
        yield served


@pytest.mark.parametrize(
    ("content", "headers", "status", "message"),
    [
        (b'{"name": "a", "path": "/x", "bogus": 1}', JSON, 400, "invalid request: Object contains unknown field `bogus`"),
        (b'{"name": 5, "path": "/x"}', JSON, 400, "invalid request: Expected `str`, got `int` - at `$.name`"),
        (b'{"name": "a"}', JSON, 400, "invalid request: Object missing required field `path`"),
        (b"", JSON, 400, "invalid request: the request has no JSON body"),
        (b"{", JSON, 400, "malformed JSON"),
        (b'{"name": "a", "path": "/x"}', {"content-type": "text/plain"}, 415, "content type 'text/plain'"),
        (b'{"name": "' + b"a" * ADMIN_BODY_LIMIT + b'", "path": "/x"}', JSON, 413, f"exceeds {ADMIN_BODY_LIMIT} bytes"),
    ],
)
def test_bad_bodies_are_refused_in_the_admin_envelope(
    url: str, content: bytes, headers: dict[str, str], status: int, message: str
) -> None:
    r = httpx.post(f"{url}{LOAD}", content=content, headers={**headers, **ADMIN_HEADERS})
    assert r.status_code == status, r.text
    assert list(r.json()) == ["error"] and message in r.json()["error"], r.text
    assert r.headers["x-request-id"]


def test_a_good_body_reaches_the_handler(url: str) -> None:
    r = httpx.post(f"{url}{LOAD}", json={"name": "a", "path": "/x"}, headers=ADMIN_HEADERS)
    assert r.status_code == 404 and r.json() == {"error": "no deployment 'nope'"}


def test_without_the_admin_key_the_body_is_never_read(url: str) -> None:
    """Headers promising a body that never comes: the guard's 401 comes at once."""
    host, port = url.removeprefix("http://").split(":")
    started = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(f"POST {LOAD} HTTP/1.1\r\nHost: x\r\n{_json_head(1000)}\r\n".encode())
        answer = sock.recv(4096).decode("latin-1")
    assert answer.startswith("HTTP/1.1 401"), answer
    assert time.perf_counter() - started < TIMEOUT_S


def test_a_body_trickled_past_the_deadline_gets_504(url: str) -> None:
    """The old raw read had no deadline: a trickled body held the connection for as long as it liked."""
    host, port = url.removeprefix("http://").split(":")
    head = f"POST {LOAD} HTTP/1.1\r\nHost: x\r\nAuthorization: {ADMIN_HEADERS['Authorization']}\r\n{_json_head(1000)}\r\n"
    started = time.perf_counter()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S + 5) as sock:
        sock.sendall(head.encode() + b'{"name": ')
        answer = sock.recv(4096).decode("latin-1")
    assert answer.startswith("HTTP/1.1 504"), answer
    assert "request_timeout_s" in answer and time.perf_counter() - started < TIMEOUT_S + 3


def test_the_body_and_errors_are_in_the_routes_document() -> None:
    app = Litestar(route_handlers=[Router("/", route_handlers=ADAPTER_ROUTES)], dependencies=DEPENDENCIES)
    load = app.openapi_schema.to_schema()["paths"]["/admin/deployments/{deployment}/adapters"]["post"]
    assert "LoadAdapterBody" in str(load["requestBody"])
    assert {"400", "401", "404", "409", "413", "415"} <= set(load["responses"])


def _json_head(length: int) -> str:
    return f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
