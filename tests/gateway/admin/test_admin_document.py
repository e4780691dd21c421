"""The admin OpenAPI document (/admin/openapi.json, gateway/http/openapi.py) lists each admin route's
errors in the admin envelope, the reload route's included."""

from __future__ import annotations

from gateway.http.openapi import admin_document


def test_reload_lists_its_errors() -> None:
    reload = admin_document()["paths"]["/admin/reload"]["post"]
    assert {"400", "401", "403", "429"} <= set(reload["responses"])
    assert "PlainError" in str(reload["responses"]["400"])  # a refused config: {"error": "..."}


def test_every_admin_route_is_in_the_document_with_its_errors() -> None:
    """The adapters and audit routes were missing from the admin document (and audit listed no
    admin errors)."""
    paths = admin_document()["paths"]
    assert {"/admin/deployments/{deployment}/adapters", "/admin/audit", "/admin/keys"} <= set(paths)
    assert {"401", "403"} <= set(paths["/admin/audit"]["get"]["responses"])
    assert {"401", "413", "415"} <= set(paths["/admin/deployments/{deployment}/adapters"]["post"]["responses"])
