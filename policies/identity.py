"""The identify step's authenticators: API keys (policies/keys.py) and, when `auth.jwt` is set,
JWT bearer tokens (policies/jwt_auth.py). The credential's shape picks: a token has two dots and
parses as a JWT; an API key (`fg-<id>-<secret>`) never contains a dot."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from policies.jwt_auth import AuthSpec, JwtVerifier, jwt_verifier
from policies.keys import KeyService
from policies.principal import Principal


class Identity:
    """Who a credential belongs to, whichever kind it is.

    Args:
        keys: the API keys.
        auth: the config's `auth` section (`auth.jwt` null: API keys only).
        tenants: names of the configured tenants (a token's tenant claim must be one).
        clock: epoch seconds now, for token expiry (injected so tests move time).
    """

    def __init__(
        self,
        keys: KeyService,
        auth: AuthSpec,
        tenants: Collection[str],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.keys = keys
        #: the JWT verifier, or None when tokens are not configured
        self.tokens: JwtVerifier | None = jwt_verifier(auth, clock, tenants)

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

    def update_tenants(self, tenants: Collection[str]) -> None:
        """Replace the set of configured tenants (config reload) for keys and tokens alike."""
        self.keys.update_tenants(tenants)
        if self.tokens is not None:
            self.tokens.update_tenants(tenants)
