"""The console's sign-in: an opaque session cookie and the CSRF token that goes with it.

Signing in presents the admin key once (a form post, checked by `verify_admin_key`, so wrong keys
count against the same attempt limit as the admin API's). The browser then holds a cookie that is
not the key: `v1.<expiry>.<nonce>.<mac>`, where `mac` is an HMAC of the expiry and nonce keyed by
the admin key. Nothing is stored on the server, so every worker of `server.workers` accepts it, and
rotating the admin key ends every session at once (the MACs stop matching). The CSRF token is a
second HMAC, of the session's nonce: a page's forms carry it, and a state change without it (or
with another session's) is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie

from fleetgate.errors import GatewayError
from gateway.admin.guard import admin_key

COOKIE = "fleetgate_console"
#: the cookie is sent to console pages only, never to the inference or admin API routes
COOKIE_PATH = "/admin/ui"
#: a session lasts a working day; signing in again is one form
SESSION_S = 8 * 3600
_VERSION = "v1"


class NotSignedIn(Exception):
    """The request carries no valid console session (answered with the sign-in page, 401)."""


@dataclass(frozen=True)
class Session:
    nonce: str
    expires_at: int
    #: the token a state-changing form must echo (`_csrf`)
    csrf: str


def _mac(key: str, purpose: str, *parts: str) -> str:
    message = "\0".join((purpose, *parts)).encode()
    return hmac.new(key.encode(), message, hashlib.sha256).hexdigest()


def _csrf_of(key: str, nonce: str) -> str:
    return _mac(key, "fleetgate-console-csrf", nonce)


def issue(key: str, now: float | None = None) -> tuple[str, Session]:
    """A new session signed with the admin key: the cookie value and the session it stands for."""
    expires_at = int((time.time() if now is None else now) + SESSION_S)
    nonce = secrets.token_urlsafe(18)
    mac = _mac(key, "fleetgate-console-session", str(expires_at), nonce)
    return f"{_VERSION}.{expires_at}.{nonce}.{mac}", Session(nonce, expires_at, _csrf_of(key, nonce))


def verify(key: str, token: str, now: float | None = None) -> Session:
    """The session a cookie value stands for. Raises NotSignedIn when it is malformed, forged,
    signed with another admin key, or expired."""
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != _VERSION or not parts[1].isdigit():
        raise NotSignedIn("malformed session")
    _, expires, nonce, mac = parts
    expected = _mac(key, "fleetgate-console-session", expires, nonce)
    if not _same(expected, mac):
        raise NotSignedIn("invalid session")
    if int(expires) <= (time.time() if now is None else now):
        raise NotSignedIn("session expired")
    return Session(nonce, int(expires), _csrf_of(key, nonce))


def _same(expected: str, presented: str) -> bool:
    """A constant-time comparison that takes any text a client sends (compare_digest refuses
    non-ASCII str with a TypeError: that was a 500 for any request with such a cookie)."""
    return hmac.compare_digest(expected.encode(), presented.encode("utf-8", "surrogateescape"))


def current(connection: ASGIConnection[Any, Any, Any, Any]) -> Session:
    """The request's console session. Raises GatewayError 403 when the admin API is off, and
    NotSignedIn without a valid session cookie (a tenant key in any header is no session)."""
    key = admin_key(connection)
    token = connection.cookies.get(COOKIE)
    if not token:
        raise NotSignedIn("not signed in")
    return verify(key, token)


def check_csrf(connection: ASGIConnection[Any, Any, Any, Any], session: Session, presented: str) -> None:
    """Refuse (403) a state change whose form token is not this session's, or that another site sent."""
    check_origin(connection)
    if not presented or not _same(presented, session.csrf):
        raise GatewayError(403, "csrf_failed", "the form's CSRF token is missing or stale; reload the page")


def check_origin(connection: ASGIConnection[Any, Any, Any, Any]) -> None:
    """Refuse (403) a post whose Origin header names another host than the one it was sent to.

    A second wall behind SameSite=Strict and the CSRF token. The scheme is not compared: behind a
    proxy that ends TLS the gateway sees http while the browser's origin is https (the proxy must
    pass the Host header through, as it must for any same-origin check).
    """
    origin = connection.headers.get("origin")
    if origin is None:  # not a browser (curl): the CSRF token alone decides
        return
    if urlsplit(origin).netloc.lower() != connection.headers.get("host", "").lower():
        raise GatewayError(403, "cross_origin", "the console refuses posts from other origins")


def cookie(value: str, connection: ASGIConnection[Any, Any, Any, Any], max_age: int = SESSION_S) -> Cookie:
    """The session cookie: HttpOnly (no script reads it), SameSite=Strict (no other site sends it),
    Secure (see `_secure`), and scoped to the console's path."""
    return Cookie(
        key=COOKIE,
        value=value,
        path=COOKIE_PATH,
        max_age=max_age,
        httponly=True,
        secure=_secure(connection),
        samesite="strict",
    )


_LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})


def _secure(connection: ASGIConnection[Any, Any, Any, Any]) -> bool:
    """Secure unless the browser plainly talks HTTP to this machine itself.

    The gateway has no TLS of its own: deployed, TLS ends at an ingress or proxy on another host,
    whose forwarded scheme uvicorn does not trust, so "the request came over https" would almost
    never hold. The cookie is therefore Secure for every host but a loopback one reached over plain
    http (a browser keeps no Secure cookie from plain http, except on localhost itself).
    """
    if connection.url.scheme == "https":
        return True
    host = connection.headers.get("host", "").lower()
    name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
    return name not in _LOOPBACK_HOSTS
