"""A local OIDC-style issuer for tests and benches: RSA signing keys, tokens, and its JWKS served
over real HTTP on loopback (`/.well-known/jwks.json`), counting how often the set is fetched."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.servers import serve_app

ISSUER = "https://issuer.test"
AUDIENCE = "fleetgate"
JWKS_PATH = "/.well-known/jwks.json"


async def answer_lifespan(receive: Any, send: Any) -> None:
    """Complete an ASGI lifespan's startup and shutdown (the test servers hold no resources)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class Issuer:
    """Signing keys by kid; `publish` decides which public keys the JWKS lists."""

    def __init__(self) -> None:
        self.private: dict[str, Any] = {}
        self.published: list[str] = []
        self.current = ""
        #: how many times the JWKS was fetched
        self.fetches = 0

    def new_key(self, kid: str, *, publish: bool = True, sign_with: bool = True) -> None:
        self.private[kid] = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        if publish:
            self.published.append(kid)
        if sign_with:
            self.current = kid

    def jwks(self) -> dict[str, Any]:
        keys = []
        for kid in self.published:
            jwk = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.private[kid].public_key()))
            keys.append({**jwk, "kid": kid, "use": "sig", "alg": "RS256"})
        return {"keys": keys}

    def token(
        self,
        tenant: str | None = "acme",
        sub: str | None = "svc-1",
        *,
        kid: str | None = None,
        ttl_s: float = 300.0,
        **claims: Any,
    ) -> str:
        now = time.time()
        payload: dict[str, Any] = {"iss": ISSUER, "aud": AUDIENCE, "iat": int(now), "exp": now + ttl_s}
        if tenant is not None:
            payload["tenant"] = tenant
        if sub is not None:
            payload["sub"] = sub
        payload.update(claims)
        payload = {k: v for k, v in payload.items() if v is not None}
        kid = kid or self.current
        return jwt.encode(payload, self.private[kid], algorithm="RS256", headers={"kid": kid})

    def asgi(self) -> Any:
        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] == "lifespan":
                await answer_lifespan(receive, send)
                return
            status, body = 404, b"{}"
            if scope["path"] == JWKS_PATH:
                self.fetches += 1
                status, body = 200, json.dumps(self.jwks()).encode()
            headers = [(b"content-type", b"application/json")]
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        return app


def auth_yaml(jwks_url: str, refresh_interval_s: float = 30.0) -> str:
    """The `auth:` section of a gateway config that trusts this issuer."""
    return (
        f"auth: {{jwt: {{issuer: {ISSUER}, audience: {AUDIENCE}, jwks_url: '{jwks_url}', "
        f"tenant_claim: tenant, subject_claim: sub, algorithms: [RS256, ES256], leeway_s: 5, "
        f"refresh_interval_s: {refresh_interval_s}}}}}\n"
    )


@contextmanager
def serve_issuer() -> Iterator[tuple[Issuer, str]]:
    """A running issuer with one published key `k1`; yields it and its JWKS URL."""
    issuer = Issuer()
    issuer.new_key("k1")
    with serve_app(issuer.asgi()) as url:
        yield issuer, url + JWKS_PATH
