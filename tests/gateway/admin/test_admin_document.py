"""The admin OpenAPI document (/admin/openapi.json, gateway/http/openapi.py) lists each admin route's
errors in the admin envelope, the reload route's included."""

from __future__ import annotations

from gateway.http.openapi import admin_document


def test_reload_lists_its_errors() -> None:
    reload = admin_document()["paths"]["/admin/reload"]["post"]
    assert {"400", "401", "403", "429"} <= set(reload["responses"])
    assert "PlainError" in str(reload["responses"]["400"])  # a refused config: {"error": "..."}
