"""The credential a call carries, read the same from HTTP headers and gRPC metadata."""

from __future__ import annotations

from collections.abc import Mapping


def bearer_key(headers: Mapping[str, str]) -> str | None:
    """The API key from `Authorization: Bearer ...` or `x-api-key` (gRPC metadata reads the same)."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        return None
    key = headers.get("x-api-key")
    return key.strip() if key else None
