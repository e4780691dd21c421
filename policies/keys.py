"""API keys: create (secret shown once), list, revoke, authenticate.

A secret reads `fg-<key_id>-<secret>`: `key_id` (12 hex digits) is public and is the lookup prefix;
`secret` is 256 random bits. The store keeps only `sha256(key_id:secret)` (a fast hash is enough for a
high-entropy secret: there is nothing to brute-force), compared in constant time. Records are cached
for at most `cache_ttl_s` (default 0.5 s) so a revocation reaches every replica within one second.
A key's last use is written to the store in the background, at most once a minute per key and
replica, so the admin list can show it without a store write on every request.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import hmac
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable, Collection
from datetime import datetime

import structlog

from policies.errors import StoreUnavailable, Unauthenticated
from policies.principal import Principal
from policies.stores.base import StateStore, from_epoch, to_epoch
from policies.types import Budget, KeyRecord, Limits

log = structlog.get_logger(__name__)

KEY_PREFIX = "fg"
_KEY_RE = re.compile(r"^fg-([0-9a-f]{12})-([A-Za-z0-9_-]{43})$")
_MAX_CACHE = 10_000
#: a key's last use is written at most this often (per key and replica)
LAST_USED_EVERY_S = 60.0


def hash_secret(key_id: str, secret: str) -> str:
    """The stored form of a secret (bound to its key id)."""
    return hashlib.sha256(f"{key_id}:{secret}".encode()).hexdigest()


def parse_key(raw: str) -> tuple[str, str] | None:
    """Split `fg-<key_id>-<secret>` into (key_id, secret), or None when it is malformed."""
    match = _KEY_RE.match(raw)
    return (match.group(1), match.group(2)) if match else None


class KeyService:
    """Tenant API keys on a StateStore.

    Args:
        store: where keys live (shared by every replica).
        clock: epoch seconds now; injected so tests move time.
        tenants: names of the configured tenants; when given, `create` refuses others and keys of a
            tenant no longer configured stop authenticating. Update with `update_tenants`.
        cache_ttl_s: how long a looked-up record is reused (<= 1 s keeps revocation within 1 s).
        stale_if_error_s: while the store is unreachable, keep accepting a key whose record was
            fetched at most this long ago (pairs with Admission's fail_open_s; 0: never, fail closed).
    """

    def __init__(
        self,
        store: StateStore,
        clock: Callable[[], float],
        *,
        tenants: Collection[str] | None = None,
        cache_ttl_s: float = 0.5,
        stale_if_error_s: float = 0.0,
    ) -> None:
        if not 0 <= cache_ttl_s <= 1.0:
            raise ValueError(f"cache_ttl_s must be within [0, 1] s, got {cache_ttl_s}")
        self._store = store
        self._clock = clock
        self._tenants = None if tenants is None else frozenset(tenants)
        self._ttl = cache_ttl_s
        self._stale_ttl = stale_if_error_s
        self._cache: OrderedDict[str, tuple[float, KeyRecord, str]] = OrderedDict()
        #: ids the store did not know, with when it said so: a client repeating a wrong key is
        #: answered from here for `cache_ttl_s` (bounded LRU, so guesses cannot fill memory)
        self._unknown: OrderedDict[str, float] = OrderedDict()
        #: store lookups in flight by id: concurrent requests with one key share one store call
        self._inflight: dict[str, asyncio.Future[tuple[KeyRecord, str] | None]] = {}
        #: when each key's last use was last written from here (bounded LRU)
        self._use_written: OrderedDict[str, float] = OrderedDict()
        self._use_writes: set[asyncio.Task[None]] = set()

    def update_tenants(self, tenants: Collection[str] | None) -> None:
        """Replace the set of configured tenants (config reload)."""
        self._tenants = None if tenants is None else frozenset(tenants)

    async def create(
        self,
        tenant: str,
        models: list[str] | None = None,
        expires_at: datetime | None = None,
        name: str | None = None,
        *,
        limits: Limits | None = None,
        budget: Budget | None = None,
    ) -> tuple[KeyRecord, str]:
        """Create a key; returns its record and its secret (the only time the secret is seen).

        `limits` and `budget` are the key's own, enforced beside its tenant's (a key cannot get more
        than its tenant: both must admit a request).

        Raises:
            ValueError: unknown tenant, an empty model glob, or an expiry in the past.
        """
        if self._tenants is not None and tenant not in self._tenants:
            raise ValueError(f"unknown tenant {tenant!r} (configured: {', '.join(sorted(self._tenants))})")
        globs = list(models) if models else ["*"]
        if any(not isinstance(g, str) or not g.strip() for g in globs):
            raise ValueError("model globs must be non-empty strings")
        now = self._clock()
        if expires_at is not None and to_epoch(expires_at) <= now:
            raise ValueError(f"expires_at {expires_at.isoformat()} is not in the future")
        while True:
            key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
            record = KeyRecord(
                key_id=key_id,
                tenant=tenant,
                models=globs,
                name=name,
                created_at=from_epoch(now),
                expires_at=from_epoch(to_epoch(expires_at)),
                limits=None if limits == Limits() else limits,
                budget=None if budget == Budget() else budget,
            )
            if await self._store.put_key(record, hash_secret(key_id, secret)):
                self._unknown.pop(key_id, None)
                break  # else: a 48-bit id collided; draw again
        log.info("api_key_created", tenant=tenant, key_id=key_id)
        return record, f"{KEY_PREFIX}-{key_id}-{secret}"

    async def list(self, tenant: str | None = None) -> builtins.list[KeyRecord]:
        """Key records (no secrets, no hashes), of one tenant or all, oldest first."""
        return await self._store.list_keys(tenant)

    async def revoke(self, key_id: str) -> bool:
        """Revoke a key on every replica (within `cache_ttl_s`); False when no such key exists."""
        self._cache.pop(key_id, None)
        found = await self._store.revoke_key(key_id, self._clock())
        if found:
            log.info("api_key_revoked", key_id=key_id)
        return found

    async def authenticate(self, raw: str | None) -> Principal:
        """The Principal of a presented secret.

        Raises:
            Unauthenticated: missing, malformed, unknown, revoked or expired key (the message never
                contains what was presented).
            StoreUnavailable: the store cannot be reached and the key is not cached.
        """
        if not raw:
            raise Unauthenticated("missing API key: send 'Authorization: Bearer <key>' or 'x-api-key'")
        parsed = parse_key(raw.strip())
        if parsed is None:
            raise Unauthenticated("malformed API key")
        key_id, secret = parsed
        found = await self._lookup(key_id)
        # Compare even when the id is unknown, so timing does not tell known ids from unknown ones.
        expected = found[1] if found else "0" * 64
        if not hmac.compare_digest(expected, hash_secret(key_id, secret)) or found is None:
            raise Unauthenticated("invalid API key")
        record = found[0]
        now = self._clock()
        if record.revoked_at is not None:
            raise Unauthenticated(f"API key {key_id} has been revoked")
        if not record.active(now):
            raise Unauthenticated(f"API key {key_id} has expired")
        if self._tenants is not None and record.tenant not in self._tenants:
            raise Unauthenticated(f"API key {key_id} belongs to a tenant that is no longer configured")
        self._note_use(key_id, now)
        return Principal(
            record.tenant, key_id, tuple(record.models), limits=record.limits, budget=record.budget
        )

    def _note_use(self, key_id: str, now: float) -> None:
        """Write the key's last use in the background, unless this replica wrote it within a minute."""
        written = self._use_written.get(key_id)
        if written is not None and now - written < LAST_USED_EVERY_S:
            return
        self._use_written[key_id] = now
        self._use_written.move_to_end(key_id)
        if len(self._use_written) > _MAX_CACHE:
            self._use_written.popitem(last=False)
        task = asyncio.ensure_future(self._write_use(key_id, now))
        self._use_writes.add(task)
        task.add_done_callback(self._use_writes.discard)

    async def _write_use(self, key_id: str, at: float) -> None:
        try:
            await self._store.touch_key(key_id, at)
        except Exception as exc:  # noqa: BLE001 - best effort: the request itself was served
            log.warning("api_key_last_use_not_written", key_id=key_id, error=f"{type(exc).__name__}: {exc}")

    async def uses_written(self) -> None:
        """Wait for the last-use writes in flight (tests, and a clean shutdown)."""
        while self._use_writes:
            await asyncio.gather(*self._use_writes, return_exceptions=True)

    async def still_valid(self, key_id: str) -> bool:
        """Whether key `key_id` would still authenticate (known, not revoked, not expired, its tenant
        configured): for work a key started that runs on without it (batch jobs)."""
        found = await self._lookup(key_id)
        if found is None:
            return False
        record = found[0]
        tenant_known = self._tenants is None or record.tenant in self._tenants
        return record.revoked_at is None and record.active(self._clock()) and tenant_known

    async def budget_of(self, key_id: str) -> Budget | None:
        """The key's own spending limit (None: it has none, or `key_id` is not an API key): for work
        the key started that runs on without it, which its budget still bounds (batch jobs)."""
        found = await self._lookup(key_id)
        return found[0].budget if found is not None else None

    async def _lookup(self, key_id: str) -> tuple[KeyRecord, str] | None:
        now = self._clock()
        cached = self._cache.get(key_id)
        if cached is not None and now - cached[0] < self._ttl:
            return cached[1], cached[2]
        unknown_at = self._unknown.get(key_id)
        if unknown_at is not None and now - unknown_at < self._ttl:
            return None
        pending = self._inflight.get(key_id)
        if pending is None:
            # its own task: a caller that goes away does not cancel the lookup the others wait on
            pending = asyncio.ensure_future(self._fetch(key_id, now, cached))
            self._inflight[key_id] = pending
            pending.add_done_callback(
                lambda done: self._inflight.pop(key_id) if self._inflight.get(key_id) is done else None
            )
        return await asyncio.shield(pending)

    async def _fetch(
        self, key_id: str, now: float, cached: tuple[float, KeyRecord, str] | None
    ) -> tuple[KeyRecord, str] | None:
        try:
            found = await self._store.get_key(key_id)
        except StoreUnavailable:
            if cached is not None and now - cached[0] < self._stale_ttl:
                log.warning("api_key_served_stale", key_id=key_id, age_s=now - cached[0])
                return cached[1], cached[2]
            raise
        if found is None:
            self._cache.pop(key_id, None)
            self._unknown[key_id] = now
            self._unknown.move_to_end(key_id)
            if len(self._unknown) > _MAX_CACHE:
                self._unknown.popitem(last=False)
            return None
        self._cache[key_id] = (now, found[0], found[1])
        self._cache.move_to_end(key_id)
        if len(self._cache) > _MAX_CACHE:
            self._cache.popitem(last=False)
        return found
