"""The console's routes under /admin/ui: sign-in, five pages (the audit trail the fifth), and their actions.

Pages need a session (gateway/admin/console/session.py); every post also needs the session's CSRF token.
Actions call the admin API's own functions (gateway/admin/api.py, gateway/admin/reload.py), so a key made
here is made exactly as `POST /admin/keys` or `fleetgate keys create` makes it.
"""

from __future__ import annotations

import structlog
from litestar import Request, Response, Router, get, post
from litestar.response import Template
from litestar.static_files import create_static_files_router

from backends.errors import InvalidInput
from fleetgate.errors import GatewayError
from gateway.admin.actor import act_as
from gateway.admin.api import CreateKeyBody, create_tenant_key, restore_canary, revoke_tenant_key
from gateway.admin.audit import read_trail
from gateway.admin.console import pages, session, views
from gateway.admin.console.pages import page, redirect, secure
from gateway.admin.console.session import NotSignedIn, Session
from gateway.admin.console.traffic import TrafficWindow, figures
from gateway.admin.guard import admin_key, verify_admin_key
from gateway.admin.reload import reload_or_refuse
from gateway.core.service import GatewayCore
from gateway.http.probes import exposition
from gateway.http.requests import json_response
from policies.types import Budget

log = structlog.get_logger(__name__)


async def _form(request: Request) -> tuple[Session, dict[str, str]]:
    """A post's session and form fields, after the CSRF check (every state change goes through here)."""
    signed = session.current(request)
    fields = await pages.read_form(request)
    session.check_csrf(request, signed, fields.get("_csrf", ""))
    act_as(request, admin_key(request), "console")  # the change this post makes is recorded as the admin's
    return signed, fields


@get("/", sync_to_thread=False)
def home(request: Request) -> Response[bytes]:
    session.current(request)
    return redirect("/tenants")


@post("/login", status_code=303)
async def login(request: Request) -> Response[bytes] | Template:
    session.check_origin(request)
    fields = await pages.read_form(request)
    try:
        verify_admin_key(request, fields.get("admin_key", ""))
    except GatewayError as exc:  # a wrong key is the sign-in form again; off (403) or throttled (429) not
        if exc.status != 401:
            raise
        log.warning("console_sign_in_refused", client=request.client.host if request.client else None)
        return page("login", status=401, error="That is not the admin key.")
    token, _ = session.issue(admin_key(request))
    log.info("console_signed_in", client=request.client.host if request.client else None)
    response = redirect("/tenants")
    response.set_cookie(session.cookie(token, request))
    return response


@post("/logout", status_code=303)
async def logout(request: Request) -> Response[bytes]:
    await _form(request)
    response = redirect("/")
    response.set_cookie(session.cookie("", request, max_age=0))
    return response


@get("/tenants")
async def tenants_page(request: Request, core: GatewayCore) -> Template:
    signed = session.current(request)
    return page("tenants", csrf=signed.csrf, active="tenants", **await views.tenants(core))


async def _keys_page(
    core: GatewayCore, signed: Session, status: int = 200, created: dict[str, str] | None = None
) -> Template:
    records = await core.keys.list(None)
    return page(
        "keys",
        status=status,
        csrf=signed.csrf,
        active="keys",
        keys=views.key_rows(records, views.key_spend(await core.admission.key_usage(None))),
        tenants=sorted(core.config.tenants),
        created=created,
    )


@get("/keys")
async def keys_page(request: Request, core: GatewayCore) -> Template:
    return await _keys_page(core, session.current(request))


@post("/keys", status_code=201)
async def create_key(request: Request, core: GatewayCore) -> Template:
    """Create a key; the answer is the keys page with the secret, shown this once (never a URL)."""
    signed, fields = await _form(request)
    globs = [g.strip() for g in fields.get("models", "").split(",") if g.strip()]
    body = CreateKeyBody(
        tenant=fields.get("tenant", ""), models=globs or None, name=fields.get("name") or None,
        budget=_daily_budget(fields.get("budget_usd_per_day", "")),
    )  # fmt: skip
    record, secret = await create_tenant_key(core, body)
    return await _keys_page(core, signed, status=201, created={"key_id": record.key_id, "secret": secret})


def _daily_budget(text: str) -> Budget | None:
    """The key form's daily budget in USD (empty: none); 400 naming the field when it is not one."""
    if not text.strip():
        return None
    try:
        return Budget(usd_per_day=float(text))
    except ValueError as exc:
        raise InvalidInput(f"budget_usd_per_day: {exc}") from None


@post("/keys/{key_id:str}/revoke", status_code=303)
async def revoke_key(request: Request, core: GatewayCore, key_id: str) -> Response[bytes]:
    await _form(request)
    await revoke_tenant_key(core, key_id)
    return redirect("/keys")


@get("/models")
async def models_page(request: Request, core: GatewayCore) -> Template:
    signed = session.current(request)
    text = exposition(core).decode()
    return page("models", csrf=signed.csrf, active="models", **views.models(core, text))


@post("/reload", status_code=303)
async def reload_config(request: Request) -> Response[bytes]:
    """Re-read the config file through the reload path (`POST /admin/reload`, SIGHUP)."""
    await _form(request)
    await reload_or_refuse(request.app)
    return redirect("/models")


@post("/canary/restore", status_code=303)
async def canary_restore(request: Request, core: GatewayCore) -> Response[bytes]:
    """Give a rolled-back canary its weight back (model and deployment are form fields: model names
    may hold `/`, which a path segment cannot)."""
    _, fields = await _form(request)
    await restore_canary(core, fields.get("model", ""), fields.get("deployment", ""))
    return redirect("/models")


def _traffic(request: Request, core: GatewayCore) -> dict[str, object]:
    window: TrafficWindow = request.app.state.console_traffic
    old, new = window.observe(exposition(core).decode())
    return figures(old, new, views.model_deployments(core), ["", *sorted(core.config.tenants)])


@get("/traffic")
async def traffic_page(request: Request, core: GatewayCore) -> Template:
    signed = session.current(request)
    return page("traffic", csrf=signed.csrf, active="traffic", traffic=_traffic(request, core))


@get("/traffic.json")
async def traffic_json(request: Request, core: GatewayCore) -> Response[bytes]:
    """The traffic page's figures, fetched by its script every few seconds."""
    session.current(request)
    return secure(json_response(_traffic(request, core)))


@get("/audit")
async def audit_page(
    request: Request,
    since: str | None = None,
    until: str | None = None,
    actor: str | None = None,
    action: str | None = None,
    cursor: str | None = None,
) -> Template:
    """The audit trail as a table, filtered like `GET /admin/audit`, 50 entries a page."""
    signed = session.current(request)
    filters = {"since": since or "", "until": until or "", "actor": actor or "", "action": action or ""}
    trail = await read_trail(request, since=since, until=until, actor=actor, action=action, cursor=cursor)
    return page(
        "audit",
        csrf=signed.csrf,
        active="audit",
        entries=views.audit_rows(trail.entries),
        filters=filters,
        next=trail.next,
    )


STATIC = create_static_files_router(
    path="/static", directories=[pages.STATIC_DIR], name="console-static", after_request=secure
)

ROUTER = Router(
    path=pages.BASE,
    route_handlers=[
        home,
        login,
        logout,
        tenants_page,
        keys_page,
        create_key,
        revoke_key,
        models_page,
        reload_config,
        canary_restore,
        traffic_page,
        traffic_json,
        audit_page,
        STATIC,
    ],
    exception_handlers={NotSignedIn: pages.not_signed_in, Exception: pages.failed},
    include_in_schema=False,
)
