"""The audit trail on the admin side: who an admin request is, recording its change, and reading
the trail back (`GET /admin/audit`, the console's audit page, `fleetgate audit`).

    GET /admin/audit?since=&until=&actor=&action=&cursor=&limit=

`since` / `until` are ISO 8601 times or epoch seconds; `action` matches itself and its sub-actions
(`keys` matches `keys.create` and `keys.revoke`); `cursor` is the `next` of the previous page.

The admin API and the console both sign in with the one admin key (`admin.key_env`), so the actor
of either is `admin-key:<id>` (gateway/admin/actor.py), told apart by `via`.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request, Response, get
from litestar.connection import ASGIConnection

from backends.errors import InvalidInput
from gateway.admin.actor import AdminActor, current_actor
from gateway.admin.guard import ADMIN_GUARD
from gateway.core.calls import Call
from gateway.http.api_docs import ADMIN_ERRORS
from gateway.http.requests import answer_json
from policies.audit import AuditEntry, AuditLog, AuditPage, check_page, parse_when


async def record(
    action: str,
    target: str | None = None,
    *,
    before: Any = None,
    after: Any = None,
    by: AdminActor | None = None,
) -> AuditEntry:
    """Append the change just made to the audit trail, as `by` or the admin of this request.

    Called once the change is made, before it is answered: a change whose entry cannot be written
    is answered 503 (the store is the one the change itself went to).

    Raises:
        RuntimeError: no admin is known (an admin action called outside an admin request without
            `by`): a change nobody is recorded for is a bug, not something to let pass.
    """
    who = by or current_actor()
    if who is None:
        raise RuntimeError(f"admin change {action!r} outside an admin request: nobody to record it for")
    return await who.trail.append(
        actor=who.actor, action=action, target=target, before=before, after=after, client=who.client, via=who.via
    )


def parse_time(value: str | None, name: str) -> float | None:
    """Epoch seconds of a filter's time (ISO 8601, naive taken as UTC, or epoch seconds); 400 otherwise."""
    if value is None or value == "":
        return None
    try:
        return parse_when(value)
    except ValueError:
        raise InvalidInput(f"{name} must be an ISO 8601 time or epoch seconds, got {value[:40]!r}") from None


async def read_trail(
    connection: ASGIConnection[Any, Any, Any, Any],
    *,
    since: str | None = None,
    until: str | None = None,
    actor: str | None = None,
    action: str | None = None,
    cursor: str | None = None,
    limit: int = 50,
) -> AuditPage:
    """A page of the trail for these filters (shared by the API route and the console); 400 on bad input."""
    try:
        check_page(cursor or None, limit)
    except ValueError as exc:  # a limit out of range, a cursor no page gave: both name themselves
        raise InvalidInput(str(exc)) from None
    return await AuditLog(connection.app.state.store).query(
        since=parse_time(since, "since"),
        until=parse_time(until, "until"),
        actor=actor or None,
        action=action or None,
        cursor=cursor or None,
        limit=limit,
    )


@get("/admin/audit", guards=ADMIN_GUARD, responses=ADMIN_ERRORS)
async def audit_trail(
    request: Request,
    call: Call,
    since: str | None = None,
    until: str | None = None,
    actor: str | None = None,
    action: str | None = None,
    cursor: str | None = None,
    limit: int = 50,
) -> Response[bytes]:
    """The audit trail, newest first, filtered by time, actor and action; paginated by `cursor`."""

    async def work() -> tuple[Any, int]:
        page = await read_trail(
            request, since=since, until=until, actor=actor, action=action, cursor=cursor, limit=limit
        )
        return msgspec.to_builtins(page), 200

    return await answer_json(call, work)


ROUTES = [audit_trail]
