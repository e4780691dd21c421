"""The identify step's authenticators together: the credential's shape picks API key or token;
a token's subject never passes for an API key id; work started by a token runs on."""

from __future__ import annotations

import json
import time

import pytest

from policies.errors import Unauthenticated
from policies.identity import Identity
from policies.jwt_auth import AuthSpec, InvalidToken, JwtSpec
from policies.keys import KeyService
from policies.stores import StateStore
from tests.jwt_issuer import AUDIENCE, ISSUER, Issuer
from tests.policies.conftest import FakeClock


async def _identity(store: StateStore, clock: FakeClock, issuer: Issuer | None) -> Identity:
    keys = KeyService(store, clock, tenants=["acme"])
    auth = AuthSpec()
    if issuer is not None:
        auth = AuthSpec(jwt=JwtSpec(issuer=ISSUER, audience=AUDIENCE, jwks_url="http://issuer.test/jwks"))

    async def fetch(url: str) -> bytes:  # the JWKS from memory: no server in a policy test
        return json.dumps(issuer.jwks() if issuer else {"keys": []}).encode()

    return Identity(keys, auth, ["acme"], clock, fetch)


@pytest.fixture
def issuer() -> Issuer:
    made = Issuer()
    made.new_key("k1")
    return made


async def test_shape_picks_the_authenticator(store: StateStore, issuer: Issuer) -> None:
    clock = FakeClock()
    clock.now = time.time()  # the issuer signs with the real clock
    identity = await _identity(store, clock, issuer)
    _, secret = await identity.keys.create("acme")
    by_key = await identity.authenticate(secret)
    by_token = await identity.authenticate(issuer.token("acme", "svc"))
    assert by_key.key_id == secret.split("-")[1] and by_token.key_id == "jwt:svc"
    with pytest.raises(InvalidToken):
        await identity.authenticate(issuer.token("acme", "svc", ttl_s=-600))
    with pytest.raises(Unauthenticated, match="malformed API key"):
        await identity.authenticate("not-a-key")
    with pytest.raises(Unauthenticated, match="missing API key"):
        await identity.authenticate(None)


async def test_without_auth_jwt_a_token_is_just_a_bad_key(store: StateStore, issuer: Issuer) -> None:
    identity = await _identity(store, FakeClock(), None)
    with pytest.raises(Unauthenticated) as refused:
        await identity.authenticate(issuer.token())
    assert refused.value.code == "invalid_api_key"


async def test_work_of_a_token_runs_on_and_a_revoked_key_stops(store: StateStore) -> None:
    identity = await _identity(store, FakeClock(), None)
    record, _ = await identity.keys.create("acme")
    assert await identity.still_valid(record.key_id)
    await identity.keys.revoke(record.key_id)
    assert not await identity.still_valid(record.key_id)
    assert await identity.still_valid("jwt:svc")
