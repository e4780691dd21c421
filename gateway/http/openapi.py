"""The published API description: `/openapi.json` (every client route), `/docs` (interactive), and
`/admin/openapi.json` (the admin routes, behind the admin key); `GET /` points to all of them.

Litestar generates the documents (`OpenAPIConfig`) from the routes: paths and parameters from their
signatures, request bodies from their typed `data` Structs, and every error status each protocol
answers from the routes' `responses=` (gateway/http/api_docs.py). The client document is the
served app's own; the operators' routes are kept out of it (`include_in_schema=False` on their
router in gateway/http/app.py) and described by a second document, generated the same way from an
app that holds only them. Litestar also serves its own pages under `/schema` (Swagger UI there
too).

`/docs` is Swagger UI rendered by Litestar's plugin with its assets served by the gateway itself
from the `swagger-ui-bundle-v2` package (under `/docs/assets/`), so it works on an edge box that
reaches no CDN.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec
import swagger_ui_bundle
from litestar import Litestar, Request, Response, Router, get
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.openapi.spec import Components
from litestar.static_files import create_static_files_router

from gateway.admin.adapters import ROUTES as ADAPTER_ROUTES
from gateway.admin.api import ROUTES as ADMIN_ROUTES
from gateway.admin.audit import ROUTES as AUDIT_ROUTES
from gateway.admin.guard import ADMIN_GUARD
from gateway.admin.reload import ROUTES as RELOAD_ROUTES
from gateway.http.api_docs import SECURITY_SCHEMES
from gateway.http.requests import DEPENDENCIES

VERSION = "0.2.0"

#: where /docs loads Swagger UI's scripts and stylesheet from: this gateway, never a CDN
ASSETS = "/docs/assets"

SWAGGER = SwaggerRenderPlugin(
    js_url=f"{ASSETS}/swagger-ui-bundle.js",
    css_url=f"{ASSETS}/swagger-ui.css",
    standalone_preset_js_url=f"{ASSETS}/swagger-ui-standalone-preset.js",
    favicon="",  # Litestar's default icon is fetched from a CDN

)


def openapi_config(title: str) -> OpenAPIConfig:
    """Litestar's OpenAPI configuration for a document called `title`."""
    return OpenAPIConfig(
        title=title,
        version=VERSION,
        path="/schema",
        render_plugins=[SWAGGER],
        components=Components(security_schemes=dict(SECURITY_SCHEMES)),
    )


_encoder = msgspec.json.Encoder()


@cache
def admin_document() -> dict[str, Any]:
    """The admin routes' document, from an app that holds only them (built once, on first use)."""
    app = Litestar(
        # the admin key is presented as a bearer token (gateway/admin/guard.py)
        route_handlers=[
            Router(
                "/",
                route_handlers=[*ADMIN_ROUTES, *RELOAD_ROUTES, *ADAPTER_ROUTES, *AUDIT_ROUTES],
                security=[{"bearer": []}],
            )
        ],
        openapi_config=openapi_config("fleetgate admin API"),
        dependencies=DEPENDENCIES,  # `core` and `call` are injected, not client parameters
    )
    return app.openapi_schema.to_schema()


def _client_document(app: Litestar) -> dict[str, Any]:
    document = app.state.get("openapi_document")
    if document is None:  # generated on first use: Litestar caches the schema per app
        document = app.state.openapi_document = app.openapi_schema.to_schema()
    return document


@get("/openapi.json", sync_to_thread=False, include_in_schema=False)
def openapi_json(request: Request[Any, Any, Any]) -> Response[bytes]:
    return Response(content=_encoder.encode(_client_document(request.app)), media_type="application/json")


@get("/admin/openapi.json", sync_to_thread=False, guards=ADMIN_GUARD, include_in_schema=False)
def admin_openapi_json() -> Response[bytes]:
    return Response(content=_encoder.encode(admin_document()), media_type="application/json")


@get("/docs", sync_to_thread=False, include_in_schema=False)
def docs(request: Request[Any, Any, Any]) -> Response[bytes]:
    """Interactive docs: Litestar's Swagger UI page, its assets served by this gateway."""
    return Response(content=SWAGGER.render(request, _client_document(request.app)), media_type="text/html")


docs_assets = create_static_files_router(
    path=ASSETS, directories=[swagger_ui_bundle.swagger_ui_path], include_in_schema=False, name="docs_assets"
)

#: what `GET /` points to
_LINKS = {
    "docs": "/docs",
    "openapi": "/openapi.json",
    "admin_openapi": "/admin/openapi.json",
    "console": "/admin/ui",
    "health": "/health/ready",
    "metrics": "/metrics",
}
_INDEX_HTML = (
    "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>fleetgate</title></head><body>"
    f"<h1>fleetgate {VERSION}</h1><ul>"
    '<li><a href="/docs">API docs</a> (Swagger UI over <a href="/openapi.json">/openapi.json</a>)</li>'
    '<li><a href="/admin/ui">Admin console</a> (needs the admin key; off when none is set)</li>'
    '<li><a href="/health/ready">Readiness</a></li></ul></body></html>'
)


@get("/", sync_to_thread=False, include_in_schema=False)
def index(request: Request[Any, Any, Any]) -> Response[Any]:
    """Where to go from here: a small page for a browser, JSON for everything else."""
    if "text/html" in request.headers.get("accept", ""):
        return Response(content=_INDEX_HTML, media_type="text/html")
    body = _encoder.encode({"name": "fleetgate", "version": VERSION, **_LINKS})
    return Response(content=body, media_type="application/json")


ROUTES = [openapi_json, admin_openapi_json, docs, docs_assets, index]
