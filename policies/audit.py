"""The audit trail: who changed what, when and from where, appended to the state store.

Every admin mutation (keys, budgets, reloads, adapters, canaries; through the admin API, the
console or the CLI) appends one `AuditEntry` as a document of kind `audit` (the store's generic
records, so it is durable and shared on SQLite and Redis alike, and survives restarts). Entries
are only ever added: an id is never written twice, and nothing here rewrites or deletes one.

Secrets never enter an entry: callers pass records (a key's record has no secret), and `_scrub`
replaces the value of any field named like a secret on top of that.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec

from policies.stores.base import StateStore

#: the record kind of audit entries in the state store
AUDIT_KIND = "audit"
#: audit entries belong to no tenant (a tenant name is never empty, so none can collide)
AUDIT_OWNER = ""
#: fields whose values never enter an entry, at any depth
SECRET_FIELDS = frozenset({"key", "secret", "secret_hash", "token", "password", "api_key", "admin_key"})
#: largest page a query answers
MAX_PAGE = 500
#: the shape of an entry's id, which is also the cursor a page hands out
_CURSOR = re.compile(r"\d{17}-[0-9a-f]{8}")
_SCAN_PAGE = 200


class AuditEntry(msgspec.Struct, kw_only=True, frozen=True):
    """One admin mutation.

    Attributes:
        id: time-ordered and unique (`<microseconds>-<random>`); also the pagination cursor.
        at: when, in epoch seconds.
        actor: who: `admin-key:<id>` (a fingerprint of the admin key, never the key), a token's
            subject, `cli:<os user>`, or `signal:SIGHUP`.
        action: what kind of change, `<area>.<verb>`: `keys.create`, `keys.revoke`,
            `config.reload`, `adapters.load`, `adapters.unload`, `canary.restore`, `budgets.set`...
        target: what it was done to (a key id, `model/deployment`, an adapter name), if anything.
        before: the target's state before (secret-free), if it had one.
        after: its state after (secret-free), if it still has one.
        client: from where: the client address, or `local` for the CLI and signals.
        via: through what: `api`, `console`, `cli` or `signal`.
    """

    id: str
    at: float
    actor: str
    action: str
    target: str | None = None
    before: Any = None
    after: Any = None
    client: str | None = None
    via: str = "api"


class AuditPage(msgspec.Struct, frozen=True):
    """A page of entries, newest first, and the cursor of the next page (None: this was the last)."""

    entries: list[AuditEntry]
    next: str | None


_decoder = msgspec.json.Decoder(AuditEntry)


def _scrub(value: Any) -> Any:
    """`value` as plain data with every secret-named field's value replaced."""
    if isinstance(value, dict):
        return {k: "[redacted]" if str(k).lower() in SECRET_FIELDS else _scrub(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v) for v in value]
    return value


class AuditLog:
    """Appends and reads audit entries on a StateStore.

    Args:
        store: the state store shared by every replica.
        clock: epoch seconds now (injected so tests move time).
    """

    def __init__(self, store: StateStore, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock

    async def append(
        self,
        *,
        actor: str,
        action: str,
        target: str | None = None,
        before: Any = None,
        after: Any = None,
        client: str | None = None,
        via: str = "api",
    ) -> AuditEntry:
        """Append one entry (never replacing another: its id is new) and return it.

        Raises:
            StoreUnavailable: the store cannot be reached (the caller answers 503).
        """
        at = self._clock()
        entry = AuditEntry(
            id=f"{int(at * 1_000_000):017d}-{secrets.token_hex(4)}",
            at=at,
            actor=actor,
            action=action,
            target=target,
            before=_scrub(msgspec.to_builtins(before)),
            after=_scrub(msgspec.to_builtins(after)),
            client=client,
            via=via,
        )
        body = msgspec.json.encode(entry).decode()
        await self._store.put_record(AUDIT_KIND, entry.id, AUDIT_OWNER, at, body)
        return entry

    async def query(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        actor: str | None = None,
        action: str | None = None,
        cursor: str | None = None,
        limit: int = 50,
    ) -> AuditPage:
        """Entries newest first, filtered; `action` matches itself and its sub-actions (`keys`
        matches `keys.create`). `cursor` is a previous page's `next`.

        Raises:
            ValueError: `limit` outside 1..MAX_PAGE, or a `cursor` no page gave.
        """
        check_page(cursor, limit)
        found: list[AuditEntry] = []
        after = cursor
        while True:
            bodies = await self._store.list_records(AUDIT_KIND, AUDIT_OWNER, after=after, limit=_SCAN_PAGE)
            for body in bodies:
                entry = _decoder.decode(body)
                after = entry.id
                if since is not None and entry.at < since:
                    return AuditPage(found, None)  # newest first: every later one is older still
                if _matches(entry, until, actor, action):
                    found.append(entry)
                    if len(found) == limit:
                        return AuditPage(found, entry.id)
            if len(bodies) < _SCAN_PAGE:
                return AuditPage(found, None)


def check_page(cursor: str | None, limit: int) -> None:
    """Refuse a page request no reader could mean.

    Raises:
        ValueError: `limit` outside 1..MAX_PAGE, or a `cursor` that no page gave.
    """
    if not 1 <= limit <= MAX_PAGE:
        raise ValueError(f"limit must be within 1..{MAX_PAGE}, got {limit}")
    if cursor is not None and not _CURSOR.fullmatch(cursor):
        # any string sorts somewhere among the ids: a mistyped cursor silently answered the trail
        # from its start (`zzz`) or nothing at all (`0`) instead of saying so
        raise ValueError("cursor is not one a page of the trail gave (its `next`)")


def parse_when(value: str) -> float:
    """Epoch seconds of a filter's time: epoch seconds, or ISO 8601 (naive taken as UTC).

    Raises:
        ValueError: neither, or not finite.
    """
    try:
        seconds = float(value)
    except ValueError:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
        return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
    if not math.isfinite(seconds):
        raise ValueError("not a finite time")
    return seconds


def _matches(entry: AuditEntry, until: float | None, actor: str | None, action: str | None) -> bool:
    if until is not None and entry.at > until:
        return False
    if actor is not None and entry.actor != actor:
        return False
    return action is None or entry.action == action or entry.action.startswith(f"{action}.")
