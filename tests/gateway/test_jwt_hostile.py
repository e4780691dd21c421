"""Hostile bearer tokens and a hostile JWKS endpoint through a running gateway: every malformed or
forged token is a 401 in the caller's envelope (never a 500, never the token quoted back), and a key
set that answers garbage, 404, a huge body or a slow drip costs a bounded time and a 401."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import jwt
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.jwt_issuer import AUDIENCE, ISSUER, Issuer, answer_lifespan, auth_yaml, serve_issuer
from tests.servers import free_port, serve_app

pytestmark = pytest.mark.slow

V2_BODY = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0.0] * 64}]}


def _config(jwks_url: str, digits: Any, fetch_timeout_s: float = 5.0, grpc_port: int | None = None) -> Any:  # noqa: ANN401
    auth = auth_yaml(jwks_url, refresh_interval_s=1.0).replace(
        "leeway_s: 5,", f"leeway_s: 5, fetch_timeout_s: {fetch_timeout_s},"
    )
    server = f"server: {{grpc_port: {grpc_port}}}" if grpc_port else ""
    yaml = f"""
{server}
state: {{url: "memory://"}}
{auth}
tenants:
  acme: {{}}
deployments:
  ort: {{backend: onnxruntime, model: {digits.onnx_path}}}
models:
  digits: {{routes: [{{deployment: ort}}]}}
"""
    return parse_config(yaml, base_dir=Path("."))


@pytest.fixture(scope="module")
def gateway(digits: Any) -> Iterator[tuple[str, Issuer, str]]:  # noqa: ANN401
    port = free_port()
    with serve_issuer() as (issuer, jwks_url), serve_app(create_app(_config(jwks_url, digits, grpc_port=port))) as url:
        yield url, issuer, f"127.0.0.1:{port}"


def _b64(value: bytes) -> str:
    return jwt.utils.base64url_encode(value).decode()


def _signed(issuer: Issuer, header: dict[str, Any], claims: dict[str, Any]) -> str:
    """A token the issuer really signed, with whatever header and claims the test asks for."""
    base = {"iss": ISSUER, "aud": AUDIENCE, "exp": time.time() + 300}
    return jwt.encode({**base, **claims}, issuer.private["k1"], algorithm="RS256", headers=header)


def _hostile_tokens(issuer: Issuer) -> dict[str, str]:
    nested = "[" * 5000 + "]" * 5000
    deep_header = _b64(('{"alg":"RS256","kid":"k1","x":' + nested + "}").encode())
    body = _b64(json.dumps({"iss": ISSUER, "aud": AUDIENCE, "exp": time.time() + 60}).encode())
    return {
        "garbage": "not a token at all",
        "two dots of nothing": "..",
        "three dots": "a.b.c.d",
        "header not json": f"{_b64(b'{nope')}.{body}.sig",
        "header a list": f"{_b64(b'[1,2]')}.{body}.sig",
        "deeply nested header": f"{deep_header}.{body}.sig",
        "huge header": f"{_b64(json.dumps({'alg': 'RS256', 'kid': 'k1', 'x': 'A' * 6000}).encode())}.{body}.sig",
        "kid of 10 kB": f"{_b64(json.dumps({'alg': 'RS256', 'kid': 'K' * 10_000}).encode())}.{body}.sig",
        "kid a number": f"{_b64(json.dumps({'alg': 'RS256', 'kid': 7}).encode())}.{body}.sig",
        "alg a dict": f"{_b64(json.dumps({'alg': {'x': 1}, 'kid': 'k1'}).encode())}.{body}.sig",
        "alg HS256": f"{_b64(json.dumps({'alg': 'HS256', 'kid': 'k1'}).encode())}.{body}.sig",
        "signature not base64": f"{_b64(json.dumps({'alg': 'RS256', 'kid': 'k1'}).encode())}.{body}.!!!",
        "crit unknown": _signed(issuer, {"kid": "k1", "crit": ["x-unknown"], "x-unknown": 1}, {"tenant": "acme"}),
        "crit not a list": _signed(issuer, {"kid": "k1", "crit": "exp"}, {"tenant": "acme"}),
        "tenant a list": _signed(issuer, {"kid": "k1"}, {"tenant": ["acme"], "sub": "s"}),
        "tenant a number": _signed(issuer, {"kid": "k1"}, {"tenant": 7, "sub": "s"}),
        "tenant nested json": _signed(issuer, {"kid": "k1"}, {"tenant": {"a": {"b": [1]}}, "sub": "s"}),
        "sub a dict": _signed(issuer, {"kid": "k1"}, {"tenant": "acme", "sub": {"a": 1}}),
        "exp a string": _signed(issuer, {"kid": "k1"}, {"tenant": "acme", "sub": "s", "exp": "tomorrow"}),
        "exp NaN": _signed(issuer, {"kid": "k1"}, {"tenant": "acme", "sub": "s", "exp": float("nan")}),
        "exp infinite": _signed(issuer, {"kid": "k1"}, {"tenant": "acme", "sub": "s", "exp": float("inf")}),
    }


def test_hostile_tokens_are_401s_in_each_protocol(
    gateway: tuple[str, Issuer, str], capfd: pytest.CaptureFixture[str]
) -> None:
    url, issuer, _ = gateway
    tokens = _hostile_tokens(issuer)
    with httpx.Client(timeout=30) as http:
        for case, token in tokens.items():
            headers = {"Authorization": f"Bearer {token}"}
            openai = http.get(f"{url}/v1/models", headers=headers)
            assert openai.status_code == 401, (case, openai.status_code, openai.text[:300])
            assert set(openai.json()["error"]) >= {"message", "type", "code"}, case
            assert token not in openai.text, case
            if case.startswith("tenant a"):  # a list or a number is named as what it is not
                assert openai.json()["error"]["message"] == "token's tenant claim 'tenant' is missing or not a string"
            v2 = http.post(f"{url}/v2/models/digits/infer", json=V2_BODY, headers=headers)
            assert v2.status_code == 401, (case, v2.status_code, v2.text[:300])
            assert set(v2.json()) == {"error"}, case
    logged = "".join(capfd.readouterr())
    for case, token in tokens.items():
        assert token[-40:] not in logged, case


def test_hostile_tokens_are_unauthenticated_over_grpc(gateway: tuple[str, Issuer, str]) -> None:
    _, issuer, target = gateway
    with grpc.insecure_channel(target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelReadyRequest(name="digits")
        for case, token in _hostile_tokens(issuer).items():
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelReady(request, metadata=[("authorization", f"Bearer {token}")], timeout=30)
            # metadata past gRPC's soft limit (8 kB) may be refused by the transport itself, before
            # the gateway sees it (with a chance that grows to the hard limit)
            expected = {grpc.StatusCode.UNAUTHENTICATED}
            if len(token) > 7500:
                expected.add(grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert refused.value.code() in expected, (case, refused.value.details())
            assert token not in (refused.value.details() or ""), case


class _HostileJwks:
    """A JWKS endpoint that misbehaves as `mode` says (set by the test between calls)."""

    def __init__(self) -> None:
        self.mode = "garbage"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:  # noqa: ANN401
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        status = 404 if self.mode == "404" else 200
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        if self.mode == "drip":  # each byte well within a read timeout, the whole not done in 6 s
            for _ in range(30):  # (no longer: the server's shutdown at the test's end waits for it)
                await send({"type": "http.response.body", "body": b" ", "more_body": True})
                await asyncio.sleep(0.2)
        elif self.mode == "huge":  # an endless document, 1 MiB a chunk
            chunk = b'{"keys": [' + b" " * (1 << 20)
            for _ in range(200):
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        body = {"garbage": b"\x00\xffnot json", "404": b"{}", "wrong": b'{"keys": 5}'}.get(self.mode, b"")
        await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("mode", ["garbage", "404", "wrong", "drip", "huge"])
def test_a_hostile_jwks_endpoint_is_a_bounded_401(digits: Any, mode: str) -> None:  # noqa: ANN401
    jwks = _HostileJwks()
    jwks.mode = mode
    issuer = Issuer()
    issuer.new_key("k1")
    with serve_app(jwks) as jwks_base, serve_app(create_app(_config(jwks_base + "/jwks", digits, 1.0))) as url:
        started = time.monotonic()
        answer = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {issuer.token()}"}, timeout=60)
        elapsed = time.monotonic() - started
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["code"] == "token_unknown_key"
    assert elapsed < 5.0, f"{mode}: the fetch took {elapsed:.1f} s past its 1 s timeout"
