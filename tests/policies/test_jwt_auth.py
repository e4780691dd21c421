"""The JWT verifier on its own: each refusal class, the remembered tokens, the key ring's refresh
on an unknown kid and its rate limit (time moved by hand, the JWKS served from memory)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from typing import Any

import httpx
import jwt
import pytest
import structlog.testing
from cryptography.hazmat.primitives.asymmetric import ec

from policies.jwt_auth import InvalidToken, JwtSpec, JwtVerifier, looks_like_jwt
from tests.jwt_issuer import AUDIENCE, ISSUER, Issuer


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def make(issuer: Issuer, clock: Clock, **spec: Any) -> tuple[JwtVerifier, list[str]]:
    fetched: list[str] = []

    async def fetch(url: str) -> bytes:
        fetched.append(url)
        return json.dumps(issuer.jwks()).encode()

    fields: dict[str, Any] = {
        "issuer": ISSUER,
        "audience": AUDIENCE,
        "jwks_url": "http://issuer.test/jwks",
        "leeway_s": 5.0,
        "refresh_interval_s": 10.0,
        **spec,
    }
    verifier = JwtVerifier(JwtSpec(**fields), clock, tenants=["acme", "other"], fetch=fetch)
    return verifier, fetched


@pytest.fixture
def issuer() -> Issuer:
    made = Issuer()
    made.new_key("k1")
    return made


async def test_a_valid_token_names_tenant_and_subject(issuer: Issuer) -> None:
    verifier, fetched = make(issuer, Clock())
    principal = await verifier.authenticate(issuer.token("acme", "svc-7"))
    assert (principal.tenant, principal.key_id, principal.models) == ("acme", "jwt:svc-7", ("*",))
    await verifier.authenticate(issuer.token("other", "svc-8"))
    assert len(fetched) == 1  # the second token's key was cached: no network


async def test_without_subject_claim_the_tenant_is_one_subject(issuer: Issuer) -> None:
    verifier, _ = make(issuer, Clock(), subject_claim=None)
    assert (await verifier.authenticate(issuer.token("acme", None))).key_id == "jwt:*"


def _forged(issuer: Issuer, alg: str) -> str:
    """A token whose header claims `alg`, "signed" the way an attacker would try."""
    payload = {"iss": ISSUER, "aud": AUDIENCE, "exp": time.time() + 60, "tenant": "acme", "sub": "x"}
    if alg == "none":
        return jwt.encode(payload, None, algorithm="none", headers={"kid": "k1"})
    # HS256 keyed with the issuer's public key, made by hand (PyJWT refuses to make it): the
    # algorithm-confusion forgery
    def part(value: dict[str, Any]) -> str:
        return jwt.utils.base64url_encode(json.dumps(value).encode()).decode()

    signing_input = f"{part({'alg': 'HS256', 'typ': 'JWT', 'kid': 'k1'})}.{part(payload)}"
    public = json.dumps(issuer.jwks()["keys"][0]).encode()
    mac = hmac.new(public, signing_input.encode(), hashlib.sha256).digest()
    return f"{signing_input}.{jwt.utils.base64url_encode(mac).decode()}"


def _tampered(token: str) -> str:
    """The token with the payload of another one (a tenant changed): its signature no longer fits."""
    head, body, signature = token.split(".")
    claims = json.loads(jwt.utils.base64url_decode(body))
    claims["tenant"] = "other"
    forged = jwt.utils.base64url_encode(json.dumps(claims).encode()).decode()
    return f"{head}.{forged}.{signature}"


@pytest.mark.parametrize(
    ("case", "code"),
    [
        ("expired", "token_expired"),
        ("not_yet_valid", "token_not_yet_valid"),
        ("wrong_issuer", "token_wrong_issuer"),
        ("wrong_audience", "token_wrong_audience"),
        ("bad_signature", "token_bad_signature"),
        ("alg_none", "token_algorithm_not_allowed"),
        ("alg_hs256", "token_algorithm_not_allowed"),
        ("unknown_tenant", "token_unknown_tenant"),
        ("no_tenant", "token_missing_claim"),
        ("no_exp", "token_missing_claim"),
        ("unknown_kid", "token_unknown_key"),
        ("garbage", "token_malformed"),
    ],
)
async def test_each_invalid_class_is_refused_with_its_reason(issuer: Issuer, case: str, code: str) -> None:
    verifier, _ = make(issuer, Clock())
    issuer.new_key("k-unpublished", publish=False, sign_with=False)
    tokens = {
        "expired": lambda: issuer.token(ttl_s=-60),
        "not_yet_valid": lambda: issuer.token(nbf=time.time() + 60),
        "wrong_issuer": lambda: issuer.token(iss="https://evil.test"),
        "wrong_audience": lambda: issuer.token(aud="someone-else"),
        "bad_signature": lambda: _tampered(issuer.token()),
        "alg_none": lambda: _forged(issuer, "none"),
        "alg_hs256": lambda: _forged(issuer, "HS256"),
        "unknown_tenant": lambda: issuer.token("nobody"),
        "no_tenant": lambda: issuer.token(None),
        "no_exp": lambda: issuer.token(exp=None),
        "unknown_kid": lambda: issuer.token(kid="k-unpublished"),
        "garbage": lambda: "abc.def.ghi",
    }
    token = tokens[case]()
    with pytest.raises(InvalidToken) as refused:
        await verifier.authenticate(token)
    assert refused.value.code == code
    assert refused.value.status == 401
    assert token not in refused.value.message


async def test_leeway_accepts_small_clock_skew(issuer: Issuer) -> None:
    clock = Clock()
    verifier, _ = make(issuer, clock)
    token = issuer.token(ttl_s=60)
    clock.now += 63  # 3 s past exp, within the 5 s leeway
    await verifier.authenticate(token)


async def test_a_remembered_token_still_expires(issuer: Issuer) -> None:
    clock = Clock()
    verifier, _ = make(issuer, clock)
    token = issuer.token(ttl_s=60)
    await verifier.authenticate(token)
    clock.now += 120
    with pytest.raises(InvalidToken, match="expired"):
        await verifier.authenticate(token)


async def test_a_remembered_token_of_a_removed_tenant_is_refused(issuer: Issuer) -> None:
    verifier, _ = make(issuer, Clock())
    token = issuer.token("other")
    await verifier.authenticate(token)
    verifier.update_tenants(["acme"])
    with pytest.raises(InvalidToken) as refused:
        await verifier.authenticate(token)
    assert refused.value.code == "token_unknown_tenant"


async def test_rotation_fetches_once_and_accepts_the_new_key(issuer: Issuer) -> None:
    clock = Clock()
    verifier, fetched = make(issuer, clock)
    await verifier.authenticate(issuer.token())
    clock.now += 11  # past the refresh interval
    issuer.new_key("k2")
    # many requests with the new kid at once share one fetch
    await asyncio.gather(*(verifier.authenticate(issuer.token(sub=f"s{i}")) for i in range(20)))
    assert len(fetched) == 2


async def test_unknown_kids_fetch_at_most_once_per_interval(issuer: Issuer) -> None:
    clock = Clock()
    verifier, fetched = make(issuer, clock)
    await verifier.authenticate(issuer.token())
    clock.now += 11
    issuer.new_key("k-unpublished", publish=False)
    for step in range(30):  # 30 s of a flood of unknown kids, a token every second
        with pytest.raises(InvalidToken):
            await verifier.authenticate(issuer.token(sub=f"s{step}"))
        clock.now += 1
    # the first fetch, then one at the start of each 10 s interval of the flood
    assert len(fetched) == 1 + 3


async def test_an_old_key_set_is_refreshed_in_the_background(issuer: Issuer) -> None:
    clock = Clock()
    verifier, fetched = make(issuer, clock, max_age_s=100.0)
    await verifier.authenticate(issuer.token())
    clock.now += 101
    await verifier.authenticate(issuer.token(sub="later"))  # answered from the cached key
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(fetched) == 2


async def test_es256_keys_verify(issuer: Issuer) -> None:
    private = ec.generate_private_key(ec.SECP256R1())
    jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(private.public_key()))

    async def fetch(url: str) -> bytes:
        return json.dumps({"keys": [{**jwk, "kid": "e1"}]}).encode()

    spec = JwtSpec(issuer=ISSUER, audience=AUDIENCE, jwks_url="https://x/jwks", algorithms=["ES256"])
    verifier = JwtVerifier(spec, time.time, tenants=["acme"], fetch=fetch)
    payload = {"iss": ISSUER, "aud": AUDIENCE, "exp": time.time() + 60, "tenant": "acme", "sub": "e"}
    token = jwt.encode(payload, private, algorithm="ES256", headers={"kid": "e1"})
    assert (await verifier.authenticate(token)).key_id == "jwt:e"


def test_config_refuses_symmetric_and_none_algorithms() -> None:
    for bad in (["HS256"], ["none"], []):
        with pytest.raises(ValueError):
            JwtSpec(issuer=ISSUER, audience=AUDIENCE, jwks_url="https://x/jwks", algorithms=bad)
    with pytest.raises(ValueError):
        JwtSpec(issuer=ISSUER, audience=AUDIENCE, jwks_url="file:///etc/keys")
    # no request could be made to these: refused when read, without repeating the URL
    for url in ("https://u:s3cret@issuer.test:70000/jwks", "https://", "https://issuer .test/jwks"):
        with pytest.raises(ValueError) as refused:
            JwtSpec(issuer=ISSUER, audience=AUDIENCE, jwks_url=url)
        assert "s3cret" not in str(refused.value)


def test_shape_tells_tokens_from_api_keys(issuer: Issuer) -> None:
    assert looks_like_jwt(issuer.token())
    assert not looks_like_jwt("fg-0123456789ab-" + "a" * 43)
    assert not looks_like_jwt("a.b.c")


async def test_a_failed_fetch_logs_neither_the_urls_credentials_nor_the_answer(issuer: Issuer) -> None:
    url = "https://reader:s3cret-pass@issuer.test/jwks?access_token=tok-123"

    async def fetch(asked: str) -> bytes:
        request = httpx.Request("GET", asked)
        response = httpx.Response(403, request=request, text="denied for tok-123")
        raise httpx.HTTPStatusError(f"403 for {asked}", request=request, response=response)

    spec = JwtSpec(issuer=ISSUER, audience=AUDIENCE, jwks_url=url)
    verifier = JwtVerifier(spec, time.time, tenants=["acme"], fetch=fetch)
    with structlog.testing.capture_logs() as logged:
        with pytest.raises(InvalidToken):
            await verifier.authenticate(issuer.token())
    (line,) = [entry for entry in logged if entry["event"] == "jwks_fetch_failed"]
    assert line["error"] == "HTTP 403" and line["url"] == "https://issuer.test/jwks"
    assert "s3cret" not in repr(logged) and "tok-123" not in repr(logged)


async def test_a_subject_longer_than_oidcs_bound_is_refused(issuer: Issuer) -> None:
    verifier, _ = make(issuer, Clock())
    assert (await verifier.authenticate(issuer.token(sub="s" * 255))).key_id == "jwt:" + "s" * 255
    with pytest.raises(InvalidToken) as refused:
        await verifier.authenticate(issuer.token(sub="s" * 10_000))
    assert refused.value.code == "token_malformed" and "s" * 20 not in str(refused.value)
