"""The console's security rules over plain HTTP (no browser): sessions, cookie flags, CSRF, CSP,
escaping, tenant keys refused, bad input answered with its status, and the actions' effects."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from litestar.testing import TestClient

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import ADMIN_KEY, create_key
from tests.gateway.admin.console.conftest import SCRIPT_TENANT, infer
from tests.gateway.test_llm_gateway import _config as llm_gateway_config
from tests.servers import serve_app

GET_ROUTES = ["/", "/tenants", "/keys", "/models", "/traffic", "/traffic.json", "/audit"]
POST_ROUTES = ["/keys", "/keys/0123456789ab/revoke", "/reload", "/logout", "/canary/restore"]
_CSRF = re.compile(r'name="_csrf" value="([^"]+)"')


@contextmanager
def signed_in(ui: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=ui, timeout=30) as client:
        r = client.post("/login", data={"admin_key": ADMIN_KEY})
        assert r.status_code == 303, r.text
        yield client


def csrf_of(client: httpx.Client, path: str = "/keys") -> str:
    match = _CSRF.search(client.get(path).text)
    assert match, "the page carries no CSRF token"
    return match.group(1)


def test_every_route_refuses_no_session_and_tenant_keys(console_gateway):
    ui = console_gateway.ui
    tenant_key = create_key(console_gateway.url, "acme")
    attempts = [
        {},
        {"headers": {"Authorization": f"Bearer {tenant_key}"}},
        {"headers": {"x-api-key": tenant_key}},
        {"cookies": {"fleetgate_console": tenant_key}},
        # the admin key itself is for the API: the console takes only its own session
        {"headers": {"Authorization": f"Bearer {ADMIN_KEY}"}},
    ]
    for extra in attempts:
        with httpx.Client(base_url=ui, **extra) as client:
            for path in GET_ROUTES:
                r = client.get(path)
                assert r.status_code == 401, (path, extra, r.status_code)
                assert 'name="admin_key"' in r.text  # the sign-in form, not the page
            for path in POST_ROUTES:
                r = client.post(path, data={"_csrf": "x"})
                assert r.status_code == 401, (path, extra, r.status_code)
    r = httpx.post(f"{ui}/login", data={"admin_key": tenant_key})
    assert r.status_code == 401 and "not the admin key" in r.text and "set-cookie" not in r.headers
    assert infer(console_gateway.url, tenant_key).status_code == 200  # the key itself works


def test_sign_in_cookie_is_http_only_strict_and_not_the_key(console_gateway):
    r = httpx.post(f"{console_gateway.ui}/login", data={"admin_key": ADMIN_KEY})
    assert r.status_code == 303 and r.headers["location"] == "/admin/ui/tenants"
    cookie = r.headers["set-cookie"]
    flags = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
    assert {"httponly", "samesite", "path", "max-age"} <= flags
    assert "samesite=strict" in cookie.lower() and "path=/admin/ui" in cookie.lower()
    assert "secure" not in flags  # plain HTTP here: a Secure cookie would never come back
    assert ADMIN_KEY not in cookie and ADMIN_KEY not in r.headers["location"]
    with signed_in(console_gateway.ui) as client:
        page = client.get("/tenants")
        assert page.status_code == 200 and ADMIN_KEY not in page.text


def test_cookie_is_secure_over_tls(digits):
    config = parse_config("state: {url: 'memory://'}\ntenants: {t: {}}", base_dir=digits.onnx_path.parent)
    with TestClient(create_app(config), base_url="https://console.test") as client:
        r = client.post("/admin/ui/login", data={"admin_key": ADMIN_KEY}, follow_redirects=False)
        assert r.status_code == 303
        flags = {part.strip().lower() for part in r.headers["set-cookie"].split(";")}
        assert "secure" in flags and "httponly" in flags


def test_cookie_is_secure_for_any_host_but_loopback(digits):
    """TLS ends at a proxy in front of the gateway, which then sees plain http: the cookie is Secure
    for every host name a browser used, except loopback over plain http."""
    config = parse_config("state: {url: 'memory://'}\ntenants: {t: {}}", base_dir=digits.onnx_path.parent)
    with TestClient(create_app(config), base_url="http://gateway.example.com") as client:
        r = client.post("/admin/ui/login", data={"admin_key": ADMIN_KEY}, follow_redirects=False)
        assert "secure" in {part.strip().lower() for part in r.headers["set-cookie"].split(";")}


def test_a_cookie_or_token_of_any_characters_is_refused_not_a_500(console_gateway):
    ui = console_gateway.ui
    for value in ("v1.9999999999.nonce.mäc", "v1.9999999999.nönce.\u00e9\u00e9"):
        r = httpx.get(f"{ui}/tenants", headers={"cookie": f"fleetgate_console={value}".encode()})
        assert r.status_code == 401
    with signed_in(ui) as client:
        r = client.post("/keys", data={"tenant": "acme", "_csrf": "jéton"})
        assert r.status_code == 403


def test_pages_carry_a_strict_csp_and_no_inline_script(console_gateway):
    with signed_in(console_gateway.ui) as client:
        answers = [client.get(p) for p in ["/tenants", "/keys", "/models", "/traffic", "/traffic.json"]]
        answers += [httpx.get(f"{console_gateway.ui}/keys"), client.get("/static/console.js")]
        answers.append(client.post("/keys/0123456789ab/revoke", data={"_csrf": csrf_of(client)}))  # 404 page
    for r in answers:
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp, r.url
        assert "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["cache-control"] == "no-store"
        if r.headers["content-type"].startswith("text/html"):
            assert not re.search(r"<script(?![^>]*\bsrc=)", r.text), f"inline script in {r.url}"
            assert not re.search(r"\son[a-z]+=", r.text), f"inline event handler in {r.url}"
    assert [r.status_code for r in answers[-3:]] == [401, 200, 404]


def test_state_changes_need_this_sessions_csrf_token(console_gateway):
    ui = console_gateway.ui
    with signed_in(ui) as client, signed_in(ui) as other:
        before = client.get("/keys").text.count('class="key ')
        token, others = csrf_of(client), csrf_of(other)
        assert token != others
        form = {"tenant": "acme", "name": "csrf-probe"}
        for data, headers in [
            (form, {}),
            ({**form, "_csrf": "0" * 64}, {}),
            ({**form, "_csrf": others}, {}),
            ({**form, "_csrf": token}, {"origin": "https://evil.example"}),
            ({**form, "_csrf": token}, {"origin": "null"}),  # a sandboxed frame, a privacy redirect
        ]:
            r = client.post("/keys", data=data, headers=headers)
            assert r.status_code == 403, (data, headers, r.status_code)
        assert client.get("/keys").text.count('class="key ') == before
        r = client.post("/keys", data={**form, "_csrf": token}, headers={"origin": console_gateway.url})
        assert r.status_code == 201
        # behind a proxy that ends TLS the browser's origin is https while the gateway sees http
        https = console_gateway.url.replace("http://", "https://")
        assert (
            client.post("/keys", data={**form, "_csrf": token}, headers={"origin": https}).status_code == 201
        )
        assert client.get("/keys").text.count('class="key ') == before + 2


def test_names_are_shown_as_text(console_gateway):
    with signed_in(console_gateway.ui) as client:
        tenants = client.get("/tenants").text
        assert SCRIPT_TENANT not in tenants
        assert "&lt;script&gt;document.title=&#39;owned&#39;&lt;/script&gt;" in tenants
        name = '<img src=x onerror="alert(1)">'
        r = client.post("/keys", data={"tenant": SCRIPT_TENANT, "name": name, "_csrf": csrf_of(client)})
        assert r.status_code == 201
        keys = client.get("/keys").text
        assert name not in keys and SCRIPT_TENANT not in keys
        assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in keys


def test_bad_input_gets_its_status_never_a_500(console_gateway):
    with signed_in(console_gateway.ui) as client:
        token = csrf_of(client)
        r = client.post("/keys", data={"tenant": "nobody", "_csrf": token})
        assert r.status_code == 400 and "unknown tenant" in r.text
        assert client.post("/keys/ffffffffffff/revoke", data={"_csrf": token}).status_code == 404
        canary = {"model": "digits", "deployment": "digits-b", "_csrf": token}
        assert client.post("/canary/restore", data=canary).status_code == 404  # not a canary route
        r = client.post("/canary/restore", data={**canary, "model": "digits-canary"})
        assert r.status_code == 303  # a canary that was not rolled back: restoring it is harmless
        r = client.post("/keys", json={"tenant": "acme", "_csrf": token})
        assert r.status_code == 415
        r = client.post(
            "/keys",
            content=b"_csrf=" + b"a" * 20000,
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
        assert r.status_code == 413
        r = client.post(
            "/keys", content=b"\xff\xfe=\xff", headers={"content-type": "application/x-www-form-urlencoded"}
        )
        assert r.status_code == 400
        assert client.get("/no-such-page").status_code == 404
        assert client.get("/static/../templates/base.html").status_code == 404


def test_created_key_works_and_revoked_key_is_refused(console_gateway):
    with signed_in(console_gateway.ui) as client:
        r = client.post("/keys", data={"tenant": "acme", "name": "http-test", "_csrf": csrf_of(client)})
        secret = re.search(r'id="new-secret"[^>]*>([^<]+)<', r.text).group(1)
        assert secret.startswith("fg-") and secret not in client.get("/keys").text  # shown once
        key_id = secret.split("-")[1]
        row = re.compile(rf'id="key-{key_id}".*?class="last-used">([^<]*)<', re.S)
        assert row.search(client.get("/keys").text).group(1) == "never"
        assert infer(console_gateway.url, secret).status_code == 200
        deadline = time.monotonic() + 10  # written in the background after the request
        while (
            used := row.search(client.get("/keys").text).group(1)
        ) == "never" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert used.endswith(" UTC")
        r = client.post(f"/keys/{key_id}/revoke", data={"_csrf": csrf_of(client)})
        assert r.status_code == 303
        assert re.search(rf'id="key-{key_id}" class="key revoked"', client.get("/keys").text)
    deadline = time.monotonic() + 5
    while (status := infer(console_gateway.url, secret).status_code) == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert status == 401


def test_admin_key_rotation_ends_sessions_and_no_key_turns_the_console_off(console_gateway, monkeypatch):
    with signed_in(console_gateway.ui) as client:
        assert client.get("/tenants").status_code == 200
        monkeypatch.setenv("FLEETGATE_ADMIN_KEY", "a-rotated-admin-key-0123456789")
        assert client.get("/tenants").status_code == 401
        monkeypatch.delenv("FLEETGATE_ADMIN_KEY")
        r = client.get("/tenants")
        assert r.status_code == 403 and "admin API is off" in r.text
        assert httpx.post(f"{console_gateway.ui}/login", data={"admin_key": ""}).status_code == 403


@pytest.mark.parametrize("path", ["/tenants", "/models"])
def test_signing_out_clears_the_cookie(console_gateway, path):
    with signed_in(console_gateway.ui) as client:
        r = client.post("/logout", data={"_csrf": csrf_of(client, path)})
        assert r.status_code == 303 and "max-age=0" in r.headers["set-cookie"].lower()
        assert client.get(path).status_code == 401


def test_models_page_shows_shadow_figures_canaries_and_deployments(console_gateway):
    key = create_key(console_gateway.url, "acme")
    for _ in range(3):
        assert infer(console_gateway.url, key, "digits-shadowed").status_code == 200
    compared = re.compile(r"compared ([0-9,]+)")
    with signed_in(console_gateway.ui) as client:
        deadline = time.monotonic() + 10  # shadows answer after the primary
        while (found := compared.search(client.get("/models").text)) is None or int(found.group(1)) < 3:
            assert time.monotonic() < deadline, "the shadow's comparisons never showed"
            time.sleep(0.1)
        page = client.get("/models").text
    assert "Shadow: digits-b (100 % mirrored)" in page and "mean max |diff| 0" in page
    canary = re.search(r'id="model-digits-canary".*?</section>', page, re.S).group(0)
    assert "watching" in canary
    for name in ("digits-a", "digits-b"):
        row = re.search(rf'id="deployment-{name}">(.*?)</tr>', page, re.S).group(1)
        assert "ready" in row and "onnxruntime" in row and "cpu" in row and "closed" in row


def test_models_page_lists_graphs_with_their_steps(console_gateway):
    with signed_in(console_gateway.ui) as client:
        page = client.get("/models").text
    section = page[page.index('id="graph-digits-cascade"') :]
    section = section[: section.index("</section>")]
    assert "first" in section and "second" in section and "digits-canary" in section
    assert "max(first.probabilities) &lt; 0.5, per row" in section
    assert "second.probabilities | first.probabilities" in section


def test_llm_kv_cache_and_token_usage(tmp_path):
    """An LLM deployment: the traffic figures carry its KV-cache use, the tenants page its tokens."""
    from backends.demo_models.tiny_llama import write_tiny_llama

    # the LLM gateway of the engine's own gateway tests: tenant acme, model `tiny` on deployment `llm`
    config = llm_gateway_config(write_tiny_llama(tmp_path / "tiny-llama"))
    with serve_app(create_app(config)) as url:
        key = create_key(url, "acme")
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        with signed_in(f"{url}/admin/ui") as client:
            traffic = client.get("/traffic.json").json()
            [kv] = [row for row in traffic["kv_cache"] if row["deployment"] == "llm"]
            assert 0.0 <= kv["usage"] <= 1.0
            tokens = r.json()["usage"]["total_tokens"]
            page = client.get("/tenants").text
            assert re.search(rf"<td>tiny</td><td>1</td><td>{tokens}</td>", page), "the month's usage row"
            assert f"{tokens} tokens" in page  # the chart's bar is labelled in tokens
