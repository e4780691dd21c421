"""The published API description: `/openapi.json` (every client route), `/docs` (interactive), and
`/admin/openapi.json` (the admin routes, behind the admin key); `GET /` points to all of them.

`/docs` is Swagger UI served by the gateway itself from the `swagger-ui-bundle-v2` package (under
`/docs/assets/`), so it works on an edge box that reaches no CDN.

The handlers read their bodies themselves (bounded reads, binary tensors, errors in each protocol's
envelope), so the framework cannot see their request and response shapes. The document is built
from the framework's view of the routes (paths, parameters) and completed here: request bodies from
the same msgspec Structs the handlers decode with, the success shapes, and every error status each
protocol answers with its envelope. Built once per process, on first use.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import msgspec
import swagger_ui_bundle
from litestar import Litestar, Request, Response, get
from litestar.openapi import OpenAPIConfig
from litestar.static_files import create_static_files_router

from gateway.admin.api import ROUTES as ADMIN_ROUTES
from gateway.admin.api import CreateKeyBody
from gateway.admin.guard import ADMIN_GUARD
from gateway.admin.reload import ROUTES as RELOAD_ROUTES
from gateway.batches.routes import ROUTES as BATCH_ROUTES
from gateway.batches.routes import CreateBatch
from gateway.http import kserve, openai, openai_embeddings, probes, tfserving
from gateway.http.requests import DEPENDENCIES
from gateway.wire.openai_schema import ChatBody, CompletionBody, EmbeddingsBody
from gateway.wire.v2_codec import InferRequestJSON

VERSION = "0.2.0"
_REF = "#/components/schemas/{name}"

#: the errors each family of routes answers, besides its success (see gateway/http/errors.py)
_ERRORS = {
    "openai": {
        400: "bad input",
        401: "missing or invalid API key",
        404: "unknown model (or one the key may not see)",
        413: "body too large",
        415: "not JSON",
        429: "rate limit, quota or queue full (Retry-After)",
        500: "the generation failed",
        502: "the upstream's answer was refused",
        503: "no healthy deployment, or the state store is down",
        504: "server.request_timeout_s passed",
    },
}
_ERRORS["v2"] = _ERRORS["tfserving"] = _ERRORS["openai"]
_ERRORS["plain"] = {
    400: "bad input",
    401: "missing or invalid admin key",
    403: "the admin API is off",
    404: "no such key, tenant or canary",
    429: "too many failed admin key attempts",
}

_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "code": {"type": "string"},
                "param": {"type": ["string", "null"]},
            },
        }
    },
}
_PLAIN_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}

_TENSOR_OUT = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "data": {"type": "array"},
        "parameters": {"type": "object"},
    },
}
_V2_RESPONSE = {
    "type": "object",
    "properties": {
        "model_name": {"type": "string"},
        "model_version": {"type": "string"},
        "id": {"type": "string"},
        "outputs": {"type": "array", "items": _TENSOR_OUT},
    },
}
_PREDICT_BODY = {
    "type": "object",
    "description": "exactly one of `instances` (row form) or `inputs` (columnar form)",
    "properties": {
        "signature_name": {"type": "string"},
        "instances": {"type": "array"},
        "inputs": {"oneOf": [{"type": "object"}, {"type": "array"}]},
    },
}
_PREDICT_RESPONSE = {
    "type": "object",
    "properties": {"predictions": {"type": "array"}, "outputs": {}},
}
_COMPLETION_RESPONSE = {
    "type": "object",
    "description": "an OpenAI completion object, or with `stream: true` Server-Sent Events of chunks",
    "properties": {
        "id": {"type": "string"},
        "object": {"type": "string"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "choices": {"type": "array", "items": {"type": "object"}},
        "usage": {"type": "object"},
    },
}


_EMBEDDINGS_RESPONSE = {
    "type": "object",
    "description": "an OpenAI list of embedding objects (float arrays, or base64 little-endian float32)",
    "properties": {
        "object": {"type": "string"},
        "data": {"type": "array", "items": {"type": "object"}},
        "model": {"type": "string"},
        "usage": {"type": "object"},
    },
}


def _protocol(path: str) -> str:
    if path.startswith("/admin"):
        return "plain"
    if path.startswith("/v2"):
        return "v2"
    if path.startswith("/v1/models/") and path != "/v1/models/{model}":
        return "tfserving"
    return "openai"


def _json_body(schema: dict[str, Any], *, binary: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if binary:  # the binary tensor extension: a JSON header then raw tensor bytes
        content["application/octet-stream"] = {
            "schema": {"type": "string", "format": "binary"},
            "description": "JSON header of Inference-Header-Content-Length bytes, then the raw tensors",
        }
    return {"required": True, "content": content}


_UPLOAD = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file", "purpose"],
                "properties": {
                    "file": {"type": "string", "format": "binary", "description": "JSONL, one request a line"},
                    "purpose": {"type": "string", "enum": ["batch"]},
                },
            }
        }
    },
}


def _request_bodies(refs: dict[str, dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    infer = _json_body(refs["InferRequestJSON"], binary=True)
    predict = _json_body(_PREDICT_BODY)
    return {
        ("/v1/files", "post"): _UPLOAD,
        ("/v1/batches", "post"): _json_body(refs["CreateBatch"]),
        ("/v1/completions", "post"): _json_body(refs["CompletionBody"]),
        ("/v1/chat/completions", "post"): _json_body(refs["ChatBody"]),
        ("/v1/embeddings", "post"): _json_body(refs["EmbeddingsBody"]),
        ("/v2/models/{model}/infer", "post"): infer,
        ("/v2/models/{model}/versions/{version}/infer", "post"): infer,
        ("/v1/models/{segment}", "post"): predict,
        ("/v1/models/{model}/versions/{segment}", "post"): predict,
        ("/v1/models/{model}/labels/{segment}", "post"): predict,
        ("/admin/keys", "post"): _json_body(refs["CreateKeyBody"]),
    }


def _success(path: str, method: str) -> dict[str, Any] | None:
    if path in ("/v1/completions", "/v1/chat/completions"):
        return _COMPLETION_RESPONSE
    if path == "/v1/embeddings":
        return _EMBEDDINGS_RESPONSE
    if path.endswith("/infer"):
        return _V2_RESPONSE
    if method == "post" and path.startswith("/v1/models/"):
        return _PREDICT_RESPONSE
    return None


def _complete(document: dict[str, Any], refs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    bodies = _request_bodies(refs)
    for path, operations in document.get("paths", {}).items():
        protocol = _protocol(path)
        for method, op in operations.items():
            if (path, method) in bodies:
                op["requestBody"] = bodies[(path, method)]
            success = _success(path, method)
            if success is not None:
                op["responses"]["200"] = {
                    "description": "success",
                    "content": {"application/json": {"schema": success}},
                }
            envelope = _OPENAI_ERROR if protocol == "openai" else _PLAIN_ERROR
            for status, why in _ERRORS[protocol].items():
                op["responses"].setdefault(
                    str(status),
                    {"description": why, "content": {"application/json": {"schema": envelope}}},
                )
            if not path.startswith("/health") and path not in ("/v2", "/v2/health/live", "/v2/health/ready"):
                op["security"] = [{"bearer": []}, {"apiKey": []}]
    components = document.setdefault("components", {})
    components["securitySchemes"] = {
        "bearer": {"type": "http", "scheme": "bearer"},
        "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
    }
    return document


def _build(handlers: list[Any], title: str) -> dict[str, Any]:
    # the same dependencies as the served app: `core` and `call` are injected, not client parameters
    app = Litestar(
        route_handlers=handlers,
        openapi_config=OpenAPIConfig(title=title, version=VERSION),
        dependencies=DEPENDENCIES,
    )
    document = app.openapi_schema.to_schema()
    _, refs = msgspec.json.schema_components(
        [ChatBody, CompletionBody, EmbeddingsBody, InferRequestJSON, CreateKeyBody, CreateBatch], ref_template=_REF
    )
    document.setdefault("components", {}).setdefault("schemas", {}).update(refs)
    named = {name: {"$ref": _REF.format(name=name)} for name in refs}
    return _complete(document, named)


@cache
def client_document() -> dict[str, Any]:
    """Every client-facing route (OpenAI, Open Inference Protocol v2, TF Serving REST, probes)."""
    handlers = [
        *openai.ROUTES,
        *openai_embeddings.ROUTES,
        *BATCH_ROUTES,
        *kserve.ROUTES,
        *tfserving.ROUTES,
        *probes.ROUTES,
    ]
    return _build(handlers, "fleetgate")


@cache
def admin_document() -> dict[str, Any]:
    return _build([*ADMIN_ROUTES, *RELOAD_ROUTES], "fleetgate admin API")


_encoder = msgspec.json.Encoder()


@get("/openapi.json", sync_to_thread=False)
def openapi_json() -> Response[bytes]:
    return Response(content=_encoder.encode(client_document()), media_type="application/json")


@get("/admin/openapi.json", sync_to_thread=False, guards=ADMIN_GUARD)
def admin_openapi_json() -> Response[bytes]:
    return Response(content=_encoder.encode(admin_document()), media_type="application/json")


#: where /docs loads Swagger UI's script and stylesheet from: this gateway, never a CDN
ASSETS = "/docs/assets"

_DOCS = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>fleetgate API</title>
<link rel="stylesheet" href="{ASSETS}/swagger-ui.css"></head>
<body><div id="ui"></div>
<script src="{ASSETS}/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({{url: "/openapi.json", dom_id: "#ui"}});</script>
</body></html>"""


@get("/docs", sync_to_thread=False, include_in_schema=False)
def docs() -> Response[str]:
    """Interactive docs (Swagger UI, its assets served by this gateway) over /openapi.json."""
    return Response(content=_DOCS, media_type="text/html")


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
