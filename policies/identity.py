"""The identify step's authenticators: API keys (policies/keys.py) and, when `auth.jwt` is set,
JWT bearer tokens (policies/jwt_auth.py). The credential's shape picks: a token has two dots and
parses as a JWT; an API key (`fg-<id>-<secret>`) never contains a dot."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection

from policies.jwt_auth import SUBJECT_PREFIX, AuthSpec, JwtVerifier, jwt_verifier
from policies.keys import KeyService
from policies.principal import Principal


class Identity:
    """Who a credential belongs to, whichever kind it is.

    Args:
        keys: the API keys.
        auth: the config's `auth` section (`auth.jwt` null: API keys only).
        tenants: names of the configured tenants (a token's tenant claim must be one).
        clock: epoch seconds now, for token expiry (injected so tests move time).
        fetch: GETs the JWKS URL (tests serve it from memory); an httpx GET by default.
    """

    def __init__(
        self,
        keys: KeyService,
        auth: AuthSpec,
        tenants: Collection[str],
        clock: Callable[[], float] = time.time,
        fetch: Callable[[str], Awaitable[bytes]] | None = None,
    ) -> None:
        self.keys = keys
        #: the JWT verifier, or None when tokens are not configured
        self.tokens: JwtVerifier | None = jwt_verifier(auth, clock, tenants, fetch)

    async def authenticate(self, raw: str | None) -> Principal:
        """The Principal of a presented credential.

        Raises:
            Unauthenticated: no credential, or one that is refused (`InvalidToken` for tokens: its
                code names the reason class); the message never contains the credential.
            StoreUnavailable: an API key could not be looked up.
        """
        if raw is not None and self.tokens is not None and self.tokens.recognizes(raw):
            return await self.tokens.authenticate(raw)
        return await self.keys.authenticate(raw)

    async def still_valid(self, key_id: str) -> bool:
        """Whether the credential behind a Principal's `key_id` would still be accepted, for work it
        started that runs on without it (batch jobs). A token's subject (`jwt:...`) stays valid: the
        gateway cannot revoke a token, and its expiry ends requests, not the work they started."""
        if key_id.startswith(SUBJECT_PREFIX):
            return True
        return await self.keys.still_valid(key_id)

    def update_tenants(self, tenants: Collection[str]) -> None:
        """Replace the set of configured tenants (config reload) for keys and tokens alike."""
        self.keys.update_tenants(tenants)
        if self.tokens is not None:
            self.tokens.update_tenants(tenants)
