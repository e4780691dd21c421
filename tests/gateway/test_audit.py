"""The audit trail: every mutating admin route (admin API and console) leaves exactly one entry
with the right actor; the trail is read back filtered and paginated, holds no secret, and
survives a restart (SQLite)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from litestar.routes import HTTPRoute

pytest.importorskip("peft")

from backends.demo_models.tiny_llama import write_tiny_llama  # noqa: E402
from gateway.admin.actor import admin_key_id  # noqa: E402
from gateway.config import load_config  # noqa: E402
from gateway.http.app import create_app  # noqa: E402
from tests.conftest import ADMIN_HEADERS, ADMIN_KEY, create_key  # noqa: E402
from tests.lora_adapters import write_peft_adapter  # noqa: E402
from tests.servers import serve_app  # noqa: E402

pytestmark = pytest.mark.slow

ACTOR = admin_key_id(ADMIN_KEY)
#: posts that change no gateway state: a console session is a signed cookie, stored nowhere
NOT_MUTATIONS = {("POST", "/admin/ui/login"), ("POST", "/admin/ui/logout")}
_CSRF = re.compile(r'name="_csrf" value="([^"]+)"')


def _yaml(onnx: Path, llm: Path, state: Path) -> str:
    return f"""
state: {{url: "sqlite:///{state}"}}
tenants:
  acme: {{}}
deployments:
  digits-a: {{backend: onnxruntime, model: {onnx}}}
  digits-b: {{backend: onnxruntime, model: {onnx}}}
  llm: {{backend: torch_llm, model: {llm}, device: cpu, options: {{max_num_seqs: 2, max_loras: 2, enable_lora: true}}}}
models:
  digits:
    routes: [{{deployment: digits-a, weight: 90}}, {{deployment: digits-b, weight: 10, canary: true}}]
  tiny: {{routes: [{{deployment: llm}}]}}
"""


@dataclass
class AuditGateway:
    url: str
    app: object
    adapter: Path
    config_path: Path
    make_app: Callable[[], object]

    def trail(self, **params: object) -> dict:
        r = httpx.get(f"{self.url}/admin/audit", params={"limit": 500, **params}, headers=ADMIN_HEADERS)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def agw(digits, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuditGateway]:  # noqa: ANN001
    root = tmp_path_factory.mktemp("audit")
    base = write_tiny_llama(root / "base", init_std=0.05, seed=3)
    adapter = write_peft_adapter(base, root / "adapter", seed=1, r=4, lora_alpha=8, target_modules=["q_proj"])
    config_path = root / "gateway.yaml"
    config_path.write_text(_yaml(digits.onnx_path, base, root / "state.db"))

    def make_app() -> object:
        return create_app(load_config(config_path), config_path=config_path)

    app = make_app()
    with serve_app(app) as url:
        yield AuditGateway(url, app, adapter, config_path, make_app)


def _mutating_routes(app: object) -> set[tuple[str, str]]:
    found = set()
    for route in app.routes:  # type: ignore[attr-defined]
        if isinstance(route, HTTPRoute) and route.path.startswith("/admin"):
            for method in route.methods & {"POST", "PUT", "PATCH", "DELETE"}:
                found.add((method, route.path))
    return found - NOT_MUTATIONS


def _console(gw: AuditGateway) -> tuple[httpx.Client, str]:
    client = httpx.Client(base_url=f"{gw.url}/admin/ui", timeout=60)
    assert client.post("/login", data={"admin_key": ADMIN_KEY}).status_code == 303
    match = _CSRF.search(client.get("/keys").text)
    assert match
    return client, match.group(1)


def _api(method: str, gw: AuditGateway, path: str, **kw: object) -> httpx.Response:
    r = httpx.request(method, f"{gw.url}{path}", headers=ADMIN_HEADERS, timeout=120, **kw)  # type: ignore[arg-type]
    assert r.status_code in (200, 201), r.text
    return r


# Each mutating route: the action its entry names, the way it is reached, what must exist first
# (made before the trail is read: a key to revoke, an adapter to unload), and the change itself,
# which returns the entry's expected target.
def _nothing(gw: AuditGateway) -> str:
    return ""


def _a_key(gw: AuditGateway) -> str:
    return create_key(gw.url, "acme").split("-")[1]


def _an_adapter(gw: AuditGateway) -> str:
    _api("POST", gw, "/admin/deployments/llm/adapters", json={"name": "gone-lora", "path": str(gw.adapter)})
    return "gone-lora"


def _api_key_create(gw: AuditGateway, _: str) -> str:
    return _api("POST", gw, "/admin/keys", json={"tenant": "acme", "name": "audited"}).json()["key_id"]


def _api_key_revoke(gw: AuditGateway, key_id: str) -> str:
    _api("DELETE", gw, f"/admin/keys/{key_id}")
    return key_id


def _api_canary(gw: AuditGateway, _: str) -> str:
    _api("POST", gw, "/admin/canary/digits/digits-b/restore")
    return "digits/digits-b"


def _api_reload(gw: AuditGateway, _: str) -> None:
    _api("POST", gw, "/admin/reload")


def _api_adapter_load(gw: AuditGateway, _: str) -> str:
    _api("POST", gw, "/admin/deployments/llm/adapters", json={"name": "acme-lora", "path": str(gw.adapter)})
    return "llm/acme-lora"


def _api_adapter_unload(gw: AuditGateway, name: str) -> str:
    _api("DELETE", gw, f"/admin/deployments/llm/adapters/{name}")
    return f"llm/{name}"


def _console_key_create(gw: AuditGateway, _: str) -> str:
    client, csrf = _console(gw)
    r = client.post("/keys", data={"_csrf": csrf, "tenant": "acme", "name": "from-console"})
    assert r.status_code == 201, r.text
    return re.search(r"fg-([0-9a-f]{12})-", r.text).group(1)  # type: ignore[union-attr]


def _console_key_revoke(gw: AuditGateway, key_id: str) -> str:
    client, csrf = _console(gw)
    assert client.post(f"/keys/{key_id}/revoke", data={"_csrf": csrf}).status_code == 303
    return key_id


def _console_reload(gw: AuditGateway, _: str) -> None:
    client, csrf = _console(gw)
    assert client.post("/reload", data={"_csrf": csrf}).status_code == 303


def _console_canary(gw: AuditGateway, _: str) -> str:
    client, csrf = _console(gw)
    form = {"_csrf": csrf, "model": "digits", "deployment": "digits-b"}
    assert client.post("/canary/restore", data=form).status_code == 303
    return "digits/digits-b"


Setup = Callable[[AuditGateway], str]
Act = Callable[[AuditGateway, str], str | None]
CASES: dict[tuple[str, str], tuple[str, str, Setup, Act]] = {
    ("POST", "/admin/keys"): ("keys.create", "api", _nothing, _api_key_create),
    ("DELETE", "/admin/keys/{key_id:str}"): ("keys.revoke", "api", _a_key, _api_key_revoke),
    ("POST", "/admin/canary/{model:str}/{deployment:str}/restore"): ("canary.restore", "api", _nothing, _api_canary),
    ("POST", "/admin/reload"): ("config.reload", "api", _nothing, _api_reload),
    ("POST", "/admin/deployments/{deployment:str}/adapters"): ("adapters.load", "api", _nothing, _api_adapter_load),
    ("DELETE", "/admin/deployments/{deployment:str}/adapters/{name:path}"): (
        "adapters.unload",
        "api",
        _an_adapter,
        _api_adapter_unload,
    ),
    ("POST", "/admin/ui/keys"): ("keys.create", "console", _nothing, _console_key_create),
    ("POST", "/admin/ui/keys/{key_id:str}/revoke"): ("keys.revoke", "console", _a_key, _console_key_revoke),
    ("POST", "/admin/ui/reload"): ("config.reload", "console", _nothing, _console_reload),
    ("POST", "/admin/ui/canary/restore"): ("canary.restore", "console", _nothing, _console_canary),
}


def test_every_mutating_admin_route_has_an_audit_case(agw: AuditGateway) -> None:
    """A new admin route that changes state fails here until it is audited and listed above."""
    assert _mutating_routes(agw.app) == set(CASES)


@pytest.mark.parametrize("route", sorted(CASES), ids=lambda r: f"{r[0]} {r[1]}")
def test_each_admin_mutation_leaves_exactly_one_entry(agw: AuditGateway, route: tuple[str, str]) -> None:
    action, via, setup, act = CASES[route]
    made = setup(agw)
    newest = agw.trail(limit=1)["entries"]
    since = newest[0]["at"] if newest else 0
    target = act(agw, made)
    entries = [e for e in agw.trail(since=since)["entries"] if not newest or e["id"] != newest[0]["id"]]
    assert len(entries) == 1, entries  # exactly one entry for the change, nothing else
    (entry,) = entries
    assert (entry["action"], entry["actor"], entry["via"], entry["client"]) == (action, ACTOR, via, "127.0.0.1")
    if target is not None:
        assert entry["target"] == target


def test_no_secret_in_the_trail_and_filters_work(agw: AuditGateway) -> None:
    created = _api("POST", agw, "/admin/keys", json={"tenant": "acme", "name": "secret-check"}).json()
    whole = httpx.get(f"{agw.url}/admin/audit", params={"limit": 500}, headers=ADMIN_HEADERS).text
    assert created["key"] not in whole and ADMIN_KEY not in whole
    entry = agw.trail(action="keys", limit=1)["entries"][0]
    assert entry["target"] == created["key_id"] and entry["after"]["tenant"] == "acme"
    assert {e["action"] for e in agw.trail(action="keys")["entries"]} <= {"keys.create", "keys.revoke"}
    assert agw.trail(actor="admin-key:nobody")["entries"] == []
    assert agw.trail(until=entry["at"] - 3600)["entries"] == []


def test_pages_follow_the_cursor_without_overlap(agw: AuditGateway) -> None:
    for _ in range(3):
        _api_key_create(agw, "")
    everything = [e["id"] for e in agw.trail()["entries"]]
    seen: list[str] = []
    cursor = None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = httpx.get(f"{agw.url}/admin/audit", params=params, headers=ADMIN_HEADERS).json()
        seen += [e["id"] for e in page["entries"]]
        cursor = page["next"]
        if cursor is None:
            break
    assert seen == everything
    ats = [e["at"] for e in agw.trail()["entries"]]
    assert ats == sorted(ats, reverse=True)


@pytest.mark.parametrize(
    ("params", "status"),
    [
        ({"since": "yesterday"}, 400),
        ({"limit": 0}, 400),
        ({"limit": 501}, 400),
        ({"limit": 10**12}, 400),
        ({"limit": "many"}, 400),
        ({"until": "nan"}, 400),
        ({"since": "1e400"}, 400),
        # a cursor no page gave: `zzz` answered the trail from its start, `0` an empty page
        ({"cursor": "zzz"}, 400),
        ({"cursor": "0"}, 400),
        ({"cursor": "9" * 5000}, 400),
    ],
)
def test_bad_filters_are_400(agw: AuditGateway, params: dict, status: int) -> None:
    r = httpx.get(f"{agw.url}/admin/audit", params=params, headers=ADMIN_HEADERS)
    assert r.status_code == status and "error" in r.json()


def test_the_console_shows_the_trail(agw: AuditGateway) -> None:
    key_id = _api_key_create(agw, "")
    client, _ = _console(agw)
    page = client.get("/audit", params={"action": "keys.create"})
    assert page.status_code == 200
    assert 'id="audit-' in page.text and key_id in page.text and ACTOR in page.text
    assert client.get("/audit", params={"since": "not a time"}).status_code == 400


def test_entries_survive_a_restart(agw: AuditGateway) -> None:
    before = agw.trail()["entries"]
    assert before
    with serve_app(agw.make_app()) as url:
        r = httpx.get(f"{url}/admin/audit", params={"limit": 500}, headers=ADMIN_HEADERS)
        assert r.json()["entries"] == before


def test_a_refused_change_leaves_no_entry(agw: AuditGateway) -> None:
    """A reload the gateway refuses (here: `auth` changed, which needs a restart) changes nothing
    and records nothing; so does revoking a key that does not exist."""
    _api_key_create(agw, "")  # an entry to compare with
    newest = agw.trail(limit=1)["entries"][0]["id"]
    original = agw.config_path.read_text()
    jwt = "auth: {jwt: {issuer: https://i.test, audience: fg, jwks_url: 'https://i.test/jwks'}}\n"
    agw.config_path.write_text(original + jwt)
    try:
        r = httpx.post(f"{agw.url}/admin/reload", headers=ADMIN_HEADERS)
        assert r.status_code == 400 and "auth changes need a restart" in r.json()["error"], r.text
    finally:
        agw.config_path.write_text(original)
    assert httpx.delete(f"{agw.url}/admin/keys/0123456789ab", headers=ADMIN_HEADERS).status_code == 404
    assert agw.trail(limit=1)["entries"][0]["id"] == newest
