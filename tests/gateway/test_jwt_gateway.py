"""JWT bearer tokens through a running gateway: OpenAI and v2 over HTTP, v2 over gRPC, beside API
keys; each invalid class refused with 401 and its reason; a signing-key rotation during traffic
gives no 401; a flood of unknown kids fetches the issuer's JWKS at most once per interval."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import jwt
import pytest
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import create_key
from tests.jwt_issuer import Issuer, auth_yaml, serve_issuer
from tests.servers import free_port, serve_app

pytestmark = pytest.mark.slow

ROW = [0.0] * 64
V2_BODY = {"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": ROW}]}


@dataclass
class TokenGateway:
    url: str
    target: str
    issuer: Issuer
    api_key: str


@pytest.fixture(scope="module")
def tgw(digits) -> Iterator[TokenGateway]:  # noqa: ANN001
    port = free_port()
    with serve_issuer() as (issuer, jwks_url):
        yaml = f"""
server: {{grpc_port: {port}}}
state: {{url: "memory://"}}
{auth_yaml(jwks_url, refresh_interval_s=1.0)}
tenants:
  acme: {{}}
  other: {{models: ["nothing*"]}}
deployments:
  ort: {{backend: onnxruntime, model: {digits.onnx_path}}}
models:
  digits: {{routes: [{{deployment: ort}}]}}
"""
        config = parse_config(yaml, base_dir=Path("."))
        with serve_app(create_app(config)) as url:
            yield TokenGateway(url, f"127.0.0.1:{port}", issuer, create_key(url, "acme"))


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_tokens_and_api_keys_both_serve_http(tgw: TokenGateway) -> None:
    token = tgw.issuer.token("acme", "svc-1")
    for credential in (token, tgw.api_key):
        models = httpx.get(f"{tgw.url}/v1/models", headers=_bearer(credential))
        assert models.status_code == 200, models.text
        assert [m["id"] for m in models.json()["data"]] == ["digits"]
        answer = httpx.post(f"{tgw.url}/v2/models/digits/infer", json=V2_BODY, headers=_bearer(credential))
        assert answer.status_code == 200, answer.text
    # x-api-key carries a token as well
    assert httpx.get(f"{tgw.url}/v1/models", headers={"x-api-key": token}).status_code == 200
    # the tenant comes from the token: `other` sees no model
    other = httpx.get(f"{tgw.url}/v1/models", headers=_bearer(tgw.issuer.token("other")))
    assert other.json()["data"] == []


def _invalid_tokens(issuer: Issuer) -> list[tuple[str, str]]:
    """(the refusal's code, a token of that class) for every class the issue names."""
    issuer.new_key("k-rogue", publish=False, sign_with=False)
    valid = issuer.token()
    head, _, signature = valid.split(".")
    other_body = issuer.token("other").split(".")[1]
    return [
        ("token_expired", issuer.token(ttl_s=-60)),
        ("token_not_yet_valid", issuer.token(nbf=time.time() + 600)),
        ("token_wrong_issuer", issuer.token(iss="https://evil.test")),
        ("token_wrong_audience", issuer.token(aud="elsewhere")),
        ("token_bad_signature", f"{head}.{other_body}.{signature}"),
        ("token_algorithm_not_allowed", _resigned(valid, "none")),
        ("token_algorithm_not_allowed", _resigned(valid, "HS256", issuer)),
        ("token_unknown_tenant", issuer.token("nobody")),
        ("token_unknown_key", issuer.token(kid="k-rogue")),
    ]


def _resigned(token: str, alg: str, issuer: Issuer | None = None) -> str:
    """The token's claims under `alg: none` (no signature) or HS256 keyed with the issuer's public
    JWK (the algorithm-confusion forgery), made by hand as an attacker would."""
    claims = json.loads(jwt.utils.base64url_decode(token.split(".")[1]))

    def part(value: dict) -> str:
        return jwt.utils.base64url_encode(json.dumps(value).encode()).decode()

    signing_input = f"{part({'alg': alg, 'kid': 'k1'})}.{part(claims)}"
    if issuer is None:
        return f"{signing_input}."
    public = json.dumps(issuer.jwks()["keys"][0]).encode()
    mac = hmac.new(public, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{jwt.utils.base64url_encode(mac).decode()}"


def test_each_invalid_class_is_a_401_naming_its_reason_over_http(
    tgw: TokenGateway, capfd: pytest.CaptureFixture[str]
) -> None:
    refused = _invalid_tokens(tgw.issuer)
    for code, token in refused:
        openai = httpx.get(f"{tgw.url}/v1/models", headers=_bearer(token))
        assert openai.status_code == 401, (code, openai.text)
        error = openai.json()["error"]
        assert error["code"] == code, error
        assert token not in openai.text
        v2 = httpx.post(f"{tgw.url}/v2/models/digits/infer", json=V2_BODY, headers=_bearer(token))
        assert v2.status_code == 401, (code, v2.text)
        assert set(v2.json()) == {"error"} and token not in v2.text
    logged = "".join(capfd.readouterr())
    assert "invalid_api_key" in logged or "token_" in logged  # the access log lines were captured
    for _, token in refused:
        signature = token.split(".")[2]
        assert token not in logged
        assert not signature or signature[:20] not in logged


def test_grpc_takes_tokens_in_authorization_metadata(tgw: TokenGateway) -> None:
    with grpc.insecure_channel(tgw.target) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelReadyRequest(name="digits")
        good = [("authorization", f"Bearer {tgw.issuer.token()}")]
        assert stub.ModelReady(request, metadata=good).ready
        for code, token in _invalid_tokens(tgw.issuer):
            with pytest.raises(grpc.RpcError) as refused:
                stub.ModelReady(request, metadata=[("authorization", f"Bearer {token}")])
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, code
            assert token not in (refused.value.details() or "")


def test_key_rotation_during_traffic_gives_no_401(tgw: TokenGateway) -> None:
    issuer = tgw.issuer
    statuses: list[int] = []
    stop = threading.Event()

    def client(n: int) -> None:
        with httpx.Client() as http:
            while not stop.is_set():
                token = issuer.token(sub=f"svc-{n}", jti=f"{n}-{time.monotonic_ns()}")
                statuses.append(http.get(f"{tgw.url}/v1/models", headers=_bearer(token)).status_code)

    # the key set held (run alone, the first client's request would fetch it 0.5 s before the
    # rotation, inside the interval), then past the refresh interval of that fetch
    assert httpx.get(f"{tgw.url}/v1/models", headers=_bearer(issuer.token())).status_code == 200
    time.sleep(1.1)
    before = issuer.fetches
    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    issuer.new_key("k-rotated")  # published and signing from now on
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    assert statuses and set(statuses) == {200}, sorted(set(statuses))
    assert issuer.fetches - before == 1  # the new kid fetched the key set once


def test_a_flood_of_unknown_kids_fetches_at_most_once_per_interval(tgw: TokenGateway) -> None:
    issuer = tgw.issuer
    issuer.new_key("k-flood", publish=False, sign_with=False)
    time.sleep(1.1)
    before = issuer.fetches
    started = time.monotonic()
    refused = 0
    with httpx.Client() as http:
        while time.monotonic() - started < 2.5:
            token = issuer.token(kid="k-flood", jti=str(time.monotonic_ns()))
            r = http.get(f"{tgw.url}/v1/models", headers=_bearer(token))
            assert r.status_code == 401 and r.json()["error"]["code"] == "token_unknown_key"
            refused += 1
    elapsed = time.monotonic() - started
    assert refused > 20
    # the interval is 1 s: one fetch at the start of each interval the flood spans
    assert issuer.fetches - before <= int(elapsed / 1.0) + 1
