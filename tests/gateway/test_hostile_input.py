"""Hostile or malformed requests get a clear 4xx in the caller's protocol, fast; probes leak nothing."""

from __future__ import annotations

import json

import httpx
import pytest

from backends.errors import InvalidInput
from tests.conftest import ADMIN_HEADERS, Gateway

V2_INFER = "/v2/models/digits/infer"


def _v2(shape: list[int], data: object, datatype: str = "FP32") -> dict[str, object]:
    return {"inputs": [{"name": "input", "shape": shape, "datatype": datatype, "data": data}]}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (_v2([2**60, 0], []), "shape dimension"),
        (_v2([1, 0], []), "shape dimension"),
        (_v2([2**40, 2**40], [0.0]), "more than"),
        (_v2([1] * 33, [0.0]), "dimensions"),
        (_v2([2, 32], [[0.0] * 32, [0.0] * 30, [0.0, 0.0]]), "nested data does not match"),
        (_v2([1, 64], [[3.5e38] + [0.0] * 63]), "out of range"),
        (_v2([1, 64], [[None] * 64]), "does not match datatype"),
    ],
)
def test_v2_bad_shapes_and_data_are_400(gateway: Gateway, body, needle) -> None:
    r = httpx.post(f"{gateway.url}{V2_INFER}", json=body, headers=gateway.headers())
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]


def test_a_shape_of_thousands_of_huge_dimensions_is_refused_before_any_arithmetic() -> None:
    """~780 KiB of dimensions (the gateway fixture's 64 KiB body limit would answer 413 first, so the
    decoder is called directly): refused on the rank alone. The product of 40,000 dims of 2^63 and a
    message quoting it used to take seconds, then fail with a 500 (an int over 4,300 digits)."""
    from gateway.wire.v2_codec import decode_infer

    body = json.dumps(_v2([2**63 - 1] * 40_000, [0.0])).encode()
    with pytest.raises(InvalidInput, match="at most 32"):
        decode_infer(body, None, "r")


def test_binary_data_size_must_be_an_integer(gateway: Gateway) -> None:
    body = {
        "inputs": [
            {"name": "input", "shape": [1, 64], "datatype": "FP32", "parameters": {"binary_data_size": True}}
        ]
    }
    r = httpx.post(f"{gateway.url}{V2_INFER}", json=body, headers=gateway.headers())
    assert r.status_code == 400


@pytest.mark.parametrize(
    ("path", "protocol"),
    [
        (V2_INFER, "v2"),
        ("/v1/models/digits:predict", "tfserving"),
        ("/v1/chat/completions", "openai"),
        ("/v1/completions", "openai"),
    ],
)
@pytest.mark.parametrize("raw", [b'{"model": "\xff\xfe"}', b"[" * 5000 + b"]" * 5000])
def test_undecodable_json_is_400_in_the_callers_envelope(gateway: Gateway, path, protocol, raw) -> None:
    r = httpx.post(
        f"{gateway.url}{path}",
        content=raw,
        headers={**gateway.headers(), "content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error["message"] if protocol == "openai" else error
    assert "malformed JSON" in message or "invalid request" in message
    assert "Traceback" not in r.text


def test_admin_key_body_with_invalid_utf8_is_400(gateway: Gateway) -> None:
    r = httpx.post(
        f"{gateway.url}/admin/keys",
        content=b'{"tenant": "\xff"}',
        headers={**ADMIN_HEADERS, "content-type": "application/json"},
    )
    assert r.status_code == 400


def test_metrics_need_a_key_and_probes_name_nothing(gateway: Gateway) -> None:
    # traffic so that /metrics holds tenant and model names
    httpx.post(f"{gateway.url}{V2_INFER}", json=_v2([1, 64], [0.0] * 64), headers=gateway.headers())
    anonymous = httpx.get(f"{gateway.url}/metrics")
    assert anonymous.status_code == 401 and "acme" not in anonymous.text
    tenant = httpx.get(f"{gateway.url}/metrics", headers=gateway.headers())
    assert tenant.status_code == 401  # a tenant's API key is not an operator's
    operator = httpx.get(f"{gateway.url}/metrics", headers=ADMIN_HEADERS)
    assert operator.status_code == 200 and 'tenant="acme"' in operator.text
    for path in ("/health/ready", "/v2/health/ready", "/health/live", "/v2/health/live"):
        r = httpx.get(f"{gateway.url}{path}")
        assert r.status_code in (200, 503)
        for name in ("digits", "echo", "acme", "remote", "onnx"):
            assert name not in r.text, (path, r.text)
    detail = httpx.get(f"{gateway.url}/health/ready", headers=ADMIN_HEADERS).json()
    assert detail["deployments"]["digits-ort"]["ready"] is True


def test_admin_key_guessing_is_slowed_down(digits) -> None:  # type: ignore[no-untyped-def]
    from pathlib import Path

    from gateway.config import parse_config
    from gateway.http.app import create_app
    from tests.servers import serve_app

    config = parse_config(
        f"""
admin: {{max_failures_per_minute: 10}}
state: {{url: "memory://"}}
tenants: {{t: {{}}}}
deployments: {{digits: {{backend: onnxruntime, model: {digits.onnx_path}}}}}
models: {{digits: {{routes: [{{deployment: digits}}]}}}}
""",
        base_dir=Path("."),
    )
    with serve_app(create_app(config)) as url:
        wrong = {"Authorization": "Bearer not-the-admin-key"}
        statuses = [httpx.get(f"{url}/admin/keys", headers=wrong).status_code for _ in range(12)]
        assert statuses[:10] == [401] * 10 and statuses[10:] == [429, 429]
        refused = httpx.get(f"{url}/admin/keys", headers=ADMIN_HEADERS)  # even the right key, for now
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1


def test_openapi_documents_every_client_route_and_keeps_admin_apart(gateway: Gateway) -> None:
    doc = httpx.get(f"{gateway.url}/openapi.json").json()
    paths = doc["paths"]
    for path in ("/v1/chat/completions", "/v2/models/{model}/infer", "/v1/models/{segment}", "/metrics"):
        assert path in paths, path
    chat = paths["/v1/chat/completions"]["post"]
    assert "requestBody" in chat and {"400", "401", "404", "429", "503"} <= set(chat["responses"])
    assert "ChatBody" in doc["components"]["schemas"]
    assert not any(p.startswith("/admin") for p in paths)
    assert "acme" not in str(doc) and "digits-ort" not in str(doc)  # no tenant or deployment names
    assert httpx.get(f"{gateway.url}/admin/openapi.json").status_code == 401
    admin = httpx.get(f"{gateway.url}/admin/openapi.json", headers=ADMIN_HEADERS).json()
    assert "/admin/keys" in admin["paths"] and "requestBody" in admin["paths"]["/admin/keys"]["post"]
    assert httpx.get(f"{gateway.url}/docs").headers["content-type"].startswith("text/html")


def test_metrics_keys_cannot_be_guessed_without_limit(digits) -> None:  # type: ignore[no-untyped-def]
    from pathlib import Path

    from gateway.config import parse_config
    from gateway.http.app import create_app
    from tests.servers import serve_app

    config = parse_config(
        'admin: {max_failures_per_minute: 5}\nstate: {url: "memory://"}\n', base_dir=Path(".")
    )
    with serve_app(create_app(config)) as url:
        wrong = {"Authorization": "Bearer guess"}
        statuses = [httpx.get(f"{url}/metrics", headers=wrong).status_code for _ in range(7)]
        assert statuses == [401] * 5 + [429] * 2
        ready = httpx.get(f"{url}/health/ready", headers=ADMIN_HEADERS)  # throttled: no detail, no error
        assert ready.status_code == 200 and "deployments" not in ready.json()
