"""Who is making an admin change: set once where the admin is recognised, read where the change
is recorded.

The admin guard (the admin API) and the console's form check (gateway/admin/console/routes.py) know
who is calling; the actions they run (create a key, reload, restore a canary...) know what changed.
The actions are shared by the API, the console and the CLI, so rather than thread the caller
through each of them, the guard puts it in a context variable of the request's task, and
`gateway.admin.audit.record` reads it there. An action run outside an admin request (a signal,
the CLI) passes its actor to `record` itself.
"""

from __future__ import annotations

import hashlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from litestar.connection import ASGIConnection

from policies.audit import AuditLog


@dataclass(frozen=True)
class AdminActor:
    """Who and from where, and the trail their changes go to."""

    #: `admin-key:<id>`, a token's subject, `cli:<user>`, `signal:SIGHUP`
    actor: str
    #: the client address, or `local`
    client: str | None
    #: `api`, `console`, `cli` or `signal`
    via: str
    trail: AuditLog


_CURRENT: ContextVar[AdminActor | None] = ContextVar("fleetgate_admin_actor", default=None)


def admin_key_id(key: str) -> str:
    """The public id of an admin key: 8 hex digits of a SHA-256 of it, enough to tell a rotated
    key's changes from its successor's; never the key."""
    return "admin-key:" + hashlib.sha256(f"fleetgate-admin-key\0{key}".encode()).hexdigest()[:8]


def act_as(connection: ASGIConnection[Any, Any, Any, Any], key: str, via: str) -> AdminActor:
    """Record that this request is made by the holder of admin key `key`, through `via`."""
    actor = AdminActor(
        actor=admin_key_id(key),
        client=connection.client.host if connection.client else None,
        via=via,
        trail=AuditLog(connection.app.state.store),
    )
    _CURRENT.set(actor)
    return actor


def current_actor() -> AdminActor | None:
    """The admin of the request being served, if `act_as` ran in it."""
    return _CURRENT.get()
