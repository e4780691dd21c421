"""Checks of the URLs the config hands to HTTP clients (the JWKS, the budget webhook), made when the
config is read: a URL that cannot be requested is refused with its field, not found at the first
token or the first budget event, where the failure would only be logged."""

from __future__ import annotations

from urllib.parse import urlsplit


def check_http_url(value: str, field: str) -> None:
    """Raise ValueError naming `field` unless `value` is an http(s) URL with a host and a valid port.

    The message never repeats the URL: it may carry a credential (user:password, a query token).
    """
    if not value.startswith(("http://", "https://")):
        raise ValueError(f"{field} must be an http:// or https:// URL")
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - reading it is the check (out of range or not a number raises)
    except ValueError:
        raise ValueError(f"{field} is not a valid URL (its host or port)") from None
    if not parts.hostname or any(c.isspace() for c in value):
        raise ValueError(f"{field} must name a host and hold no spaces")
