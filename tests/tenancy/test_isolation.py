"""Isolation matrix: every key x model x endpoint through a running gateway gives the expected status.

Tenant `a` sees `digits-a*` and `chat-a`; tenant `b` sees `digits-b*`; all digits models are the same
ONNX deployment, so a 404 can only come from visibility. A model of the other tenant must answer
exactly like a model that does not exist: same status, same body once the name is swapped, same
headers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.servers import serve_app
from tests.tenancy.conftest import (
    ADMIN_HEADERS,
    UNKNOWN_KEY,
    admin_create_key,
    bearer,
    chat_body,
    deployments_yaml,
    models_yaml,
    tf_body,
    v2_body,
)

TENSOR_MODELS = ["digits-a1", "digits-a2", "digits-b1"]
MISSING = "digits-zz"  # matches nobody's glob and does not exist


@dataclass
class World:
    url: str
    #: key name -> secret (None: no header at all)
    keys: dict[str, str | None]
    key_ids: dict[str, str]


#: which models each key may see; keys absent from here must get 401
VISIBLE = {
    "a": {"digits-a1", "digits-a2", "chat-a"},
    "a_narrow": {"digits-a1"},  # a key of tenant a restricted with models=["digits-a1"]
    "b": {"digits-b1"},
}
UNAUTHENTICATED = ["none", "malformed", "unknown", "revoked", "wrong_secret"]


@pytest.fixture(scope="module")
def world(digits, upstream_url, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:  # type: ignore[no-untyped-def]
    state = tmp_path_factory.mktemp("isolation") / "state.db"
    # these tests try every tenant key on every admin route: more failures than the default allows
    text = f"""
admin: {{max_failures_per_minute: 1000}}
state: {{url: "sqlite:///{state}"}}
tenants:
  a: {{models: ["digits-a*", "chat-a"]}}
  b: {{models: ["digits-b*"]}}
{deployments_yaml(digits, upstream_url)}
{models_yaml(TENSOR_MODELS, ["chat-a"])}
"""
    config = parse_config(text, base_dir=Path("."))
    with serve_app(create_app(config)) as url:
        a, a_id = admin_create_key(url, "a")
        narrow, narrow_id = admin_create_key(url, "a", models=["digits-a1"])
        b, b_id = admin_create_key(url, "b")
        revoked, revoked_id = admin_create_key(url, "b")
        r = httpx.delete(f"{url}/admin/keys/{revoked_id}", headers=ADMIN_HEADERS)
        assert r.status_code == 200, r.text
        # The right key id with another secret: must not authenticate.
        wrong = b[:-1] + ("B" if b[-1] != "B" else "C")
        keys: dict[str, str | None] = {
            "a": a,
            "a_narrow": narrow,
            "b": b,
            "none": None,
            "malformed": "not-a-fleetgate-key",
            "unknown": UNKNOWN_KEY,
            "revoked": revoked,
            "wrong_secret": wrong,
        }
        yield World(url, keys, {"a": a_id, "a_narrow": narrow_id, "b": b_id})


def _headers(key: str | None) -> dict[str, str]:
    return bearer(key) if key else {}


# endpoint name -> (method, path template, body, protocol of its error envelope)
ENDPOINTS = {
    "openai GET /v1/models/{m}": ("GET", "/v1/models/{m}", None, "openai"),
    "tfserving GET /v1/models/{m}/metadata": ("GET", "/v1/models/{m}/metadata", None, "plain"),
    "tfserving POST /v1/models/{m}:predict": ("POST", "/v1/models/{m}:predict", tf_body(), "plain"),
    "v2 GET /v2/models/{m}": ("GET", "/v2/models/{m}", None, "plain"),
    "v2 GET /v2/models/{m}/ready": ("GET", "/v2/models/{m}/ready", None, "plain"),
    "v2 POST /v2/models/{m}/infer": ("POST", "/v2/models/{m}/infer", v2_body(), "plain"),
}


def _call(world: World, endpoint: str, model: str, key: str | None) -> httpx.Response:
    method, path, body, _ = ENDPOINTS[endpoint]
    return httpx.request(
        method, world.url + path.format(m=model), json=body, headers=_headers(key), timeout=30
    )


def _expected(key_name: str, model: str) -> int:
    if key_name in UNAUTHENTICATED:
        return 401
    return 200 if model in VISIBLE[key_name] else 404


def _check_envelope(r: httpx.Response, protocol: str, status: int) -> None:
    body = r.json()
    if protocol == "openai":
        err = body["error"]
        assert isinstance(err, dict) and err["type"] == (
            "authentication_error" if status == 401 else "not_found_error"
        ), body
        assert isinstance(err["message"], str) and err["message"]
    else:
        assert isinstance(body["error"], str) and body["error"], body


def _shape(r: httpx.Response, model: str) -> tuple[int, object, list[str]]:
    """Status, body with the model name swapped for a placeholder, and the header names."""
    body = json.loads(r.text.replace(model, "<model>"))
    return r.status_code, body, sorted(h for h in r.headers if h not in ("date", "content-length"))


@pytest.mark.parametrize("endpoint", list(ENDPOINTS))
def test_matrix(world: World, endpoint: str) -> None:
    protocol = ENDPOINTS[endpoint][3]
    mismatches = []
    for key_name, key in world.keys.items():
        missing = _call(world, endpoint, MISSING, key)
        for model in [*TENSOR_MODELS, MISSING]:
            r = missing if model == MISSING else _call(world, endpoint, model, key)
            expected = _expected(key_name, model)
            if r.status_code != expected:
                mismatches.append(
                    f"{key_name} x {model}: {r.status_code} (expected {expected}) {r.text[:120]}"
                )
                continue
            if expected != 200:
                _check_envelope(r, protocol, expected)
                if key:
                    assert key not in r.text  # the secret is never echoed
            if expected == 404:
                # Hidden and nonexistent models are indistinguishable.
                assert _shape(r, model) == _shape(missing, MISSING), (key_name, model)
    assert not mismatches, "\n".join(mismatches)


def test_openai_model_list_contents(world: World) -> None:
    for key_name, key in world.keys.items():
        r = httpx.get(f"{world.url}/v1/models", headers=_headers(key))
        if key_name in UNAUTHENTICATED:
            assert r.status_code == 401, (key_name, r.text)
            _check_envelope(r, "openai", 401)
            continue
        assert r.status_code == 200, r.text
        assert {m["id"] for m in r.json()["data"]} == VISIBLE[key_name], key_name


def test_openai_chat_completions(world: World) -> None:
    def chat(model: str, key: str | None) -> httpx.Response:
        return httpx.post(
            f"{world.url}/v1/chat/completions", json=chat_body(model), headers=_headers(key), timeout=30
        )

    for key_name, key in world.keys.items():
        r = chat("chat-a", key)
        missing = chat("chat-zz", key)
        expected = _expected(key_name, "chat-a")
        assert r.status_code == expected, (key_name, r.text)
        if expected == 200:
            assert r.json()["choices"][0]["message"]["content"] == "three two one"
            assert r.headers["x-fleetgate-deployment"].startswith("echo;")
        else:
            _check_envelope(r, "openai", expected)
        if expected == 404:
            assert _shape(r, "chat-a") == _shape(missing, "chat-zz")
        # A tensor model on the text endpoint: visible ones are refused as such (400), hidden ones 404.
        r = chat("digits-b1", key)
        want = 401 if key_name in UNAUTHENTICATED else (400 if "digits-b1" in VISIBLE[key_name] else 404)
        assert r.status_code == want, (key_name, r.text)


def test_x_api_key_header_is_equivalent(world: World) -> None:
    key = world.keys["a"]
    assert key is not None
    ok = httpx.post(f"{world.url}/v2/models/digits-a1/infer", json=v2_body(), headers={"x-api-key": key})
    assert ok.status_code == 200, ok.text
    hidden = httpx.get(f"{world.url}/v2/models/digits-b1", headers={"x-api-key": key})
    assert hidden.status_code == 404
    bad = httpx.get(f"{world.url}/v2/models/digits-a1", headers={"x-api-key": UNKNOWN_KEY})
    assert bad.status_code == 401 and isinstance(bad.json()["error"], str)
    # An Authorization header that is not Bearer is not silently ignored in favour of x-api-key.
    basic = httpx.get(
        f"{world.url}/v2/models/digits-a1", headers={"Authorization": "Basic Zm9vOmJhcg==", "x-api-key": key}
    )
    assert basic.status_code == 401


ADMIN_CALLS = [
    ("GET", "/admin/keys", None),
    ("GET", "/admin/usage", None),
    ("POST", "/admin/keys", {"tenant": "a"}),
    ("DELETE", "/admin/keys/{own}", None),
]


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS, ids=[f"{m} {p}" for m, p, _ in ADMIN_CALLS])
def test_admin_refuses_every_tenant_key(world: World, method: str, path: str, body: object) -> None:
    for key_name, key in world.keys.items():
        # A tenant trying to revoke (or list) its own key is refused too.
        own = world.key_ids.get(key_name, "0123456789ab")
        r = httpx.request(method, world.url + path.format(own=own), json=body, headers=_headers(key))
        assert r.status_code in (401, 403), (key_name, r.status_code, r.text)
        assert isinstance(r.json()["error"], str)
    # Nothing was revoked by those attempts.
    for key_name in VISIBLE:
        key = world.keys[key_name]
        assert httpx.get(f"{world.url}/v1/models", headers=_headers(key)).status_code == 200


def test_admin_key_works_on_every_admin_endpoint(world: World) -> None:
    keys = httpx.get(f"{world.url}/admin/keys", headers=ADMIN_HEADERS)
    assert keys.status_code == 200
    listed = keys.json()["keys"]
    assert {k["key_id"] for k in listed} >= set(world.key_ids.values())
    for key in world.keys.values():
        if key:
            assert key not in keys.text  # secrets are never listed
    assert "hash" not in keys.text
    only_b = httpx.get(f"{world.url}/admin/keys", params={"tenant": "b"}, headers=ADMIN_HEADERS).json()[
        "keys"
    ]
    assert {k["tenant"] for k in only_b} == {"b"}
    usage = httpx.get(f"{world.url}/admin/usage", headers=ADMIN_HEADERS)
    assert usage.status_code == 200 and isinstance(usage.json()["usage"], list)
    empty = httpx.get(f"{world.url}/admin/usage", params={"tenant": "b"}, headers=ADMIN_HEADERS)
    assert empty.status_code == 200 and isinstance(empty.json()["usage"], list)
    typo = httpx.get(f"{world.url}/admin/usage", params={"tenant": "nobody"}, headers=ADMIN_HEADERS)
    assert typo.status_code == 404 and "nobody" in typo.json()["error"]
    secret, key_id = admin_create_key(world.url, "b")
    gone = httpx.delete(f"{world.url}/admin/keys/{key_id}", headers=ADMIN_HEADERS)
    assert gone.status_code == 200 and gone.json() == {"key_id": key_id, "revoked": True}
    assert httpx.get(f"{world.url}/v1/models", headers=bearer(secret)).status_code == 401
    again = httpx.delete(f"{world.url}/admin/keys/nosuchkey000", headers=ADMIN_HEADERS)
    assert again.status_code == 404


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"tenant": "nope"}, "unknown tenant 'nope'"),
        ({"tenant": "a", "expires_at": "not-a-time"}, "expires_at"),
        ({"tenant": "a", "expires_at": "2020-01-01T00:00:00Z"}, "not in the future"),
        ({"tenant": "a", "models": [""]}, "model globs"),
        ({"tenant": "a", "scopes": ["all"]}, "scopes"),
        ({}, "tenant"),
    ],
)
def test_admin_create_refuses_bad_input(world: World, body: dict[str, object], needle: str) -> None:
    r = httpx.post(f"{world.url}/admin/keys", json=body, headers=ADMIN_HEADERS)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]


def test_admin_api_is_off_without_its_key(world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEETGATE_ADMIN_KEY")
    r = httpx.get(f"{world.url}/admin/keys", headers=ADMIN_HEADERS)
    assert r.status_code == 403 and "FLEETGATE_ADMIN_KEY" in r.json()["error"]
