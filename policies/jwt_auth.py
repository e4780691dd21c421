"""JWT / OIDC bearer tokens: the second authenticator beside API keys (policies/identity.py picks).

A token is verified against the issuer's JWKS (`auth.jwt.jwks_url`) with PyJWT
(docs/decisions/jwt-library.md). The key set is fetched over HTTP (httpx), kept in memory, and
fetched again when a token names a `kid` it does not hold (the issuer rotated its signing key);
those fetches are rate-limited to one per `refresh_interval_s`, so a flood of made-up `kid`s
cannot turn the gateway into a load generator against the issuer. With the key cached, a request
does no network at all. A verified token is remembered (bounded, oldest forgotten first) until it expires, so a client
that presents the same token again costs a dictionary lookup and a clock compare.

Every refusal is an `InvalidToken` (401) whose code names the reason class and whose message never
contains the token.
"""

from __future__ import annotations

import base64
import binascii
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

import jwt
import msgspec
import structlog

from fleetgate.spec import SpecBase
from policies.errors import Unauthenticated
from policies.jwks import KeyRing, fetch_url
from policies.principal import Principal
from policies.urls import check_http_url

log = structlog.get_logger(__name__)

#: signature algorithms of public keys: what an issuer's JWKS can verify. `none` and the HMAC
#: algorithms (HS*) are never accepted: a JWKS is public, and an HS* token "signed" with a public
#: key is the classic algorithm-confusion forgery.
PUBLIC_KEY_ALGORITHMS = frozenset(
    {"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA"}
)
#: verified tokens remembered at once (oldest forgotten first)
_MAX_VERIFIED = 10_000
#: what a token's subject is prefixed with where a key id goes: an API key's id is 12 hex digits,
#: never with a colon, so a subject can never be taken for a key (nor a key's limits for a subject's)
SUBJECT_PREFIX = "jwt:"
#: the longest subject taken (OpenID Connect: `sub` "MUST NOT exceed 255 ASCII characters")
MAX_SUBJECT = 255
#: the subject a token without `subject_claim` is counted under (one per tenant)
TENANT_SUBJECT = "jwt:*"
#: the least `refresh_interval_s`. It is the only bound on the key set fetches that tokens naming
#: an unknown `kid` cause, and anyone can make such a token: at 0 every one of them would fetch, and
#: a flood of them would turn the gateway into a load generator against the issuer. One fetch a
#: second per process is nothing to an issuer, and a rotated key is still picked up within a second.
MIN_REFRESH_INTERVAL_S = 1.0


class JwtSpec(SpecBase):
    #: the `iss` every token must carry (exactly)
    issuer: str
    #: the `aud` a token must name (one of these, when a list)
    audience: str | list[str]
    #: the issuer's JSON Web Key Set (for OIDC: the `jwks_uri` of its discovery document)
    jwks_url: str
    #: the claim that names the tenant; it must be a configured tenant
    tenant_claim: str = "tenant"
    #: the claim that names the key-like subject that per-key limits and budgets apply to (it takes
    #: the place of the API key id, as `jwt:<subject>`); null: a tenant's tokens are one subject, `jwt:*`
    subject_claim: str | None = "sub"
    #: accepted signature algorithms (public-key ones only: RS*, PS*, ES*, EdDSA)
    algorithms: list[str] = msgspec.field(default_factory=lambda: ["RS256"])
    #: clock skew allowed when checking `exp` and `nbf`, in seconds
    leeway_s: float = 30.0
    #: the key set is fetched again (on an unknown `kid`) at most once per this many seconds; at
    #: least 1: it rate-limits the fetches that tokens with made-up `kid`s cause
    refresh_interval_s: float = 30.0
    #: the key set is also fetched again, in the background, once it is this old (keys retire)
    max_age_s: float = 3600.0
    #: how long one fetch of the key set may take
    fetch_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        check_http_url(self.jwks_url, "jwks_url")
        if not self.algorithms:
            raise ValueError("algorithms must name at least one algorithm")
        bad = sorted(set(self.algorithms) - PUBLIC_KEY_ALGORITHMS)
        if bad:
            raise ValueError(
                f"algorithms {bad} are not public-key algorithms a JWKS can verify "
                f"(allowed: {', '.join(sorted(PUBLIC_KEY_ALGORITHMS))})"
            )
        if not self.issuer or not self.audience or not self.tenant_claim:
            raise ValueError("issuer, audience and tenant_claim must not be empty")
        if self.leeway_s < 0 or self.fetch_timeout_s <= 0:
            raise ValueError("leeway_s must be >= 0, fetch_timeout_s > 0")
        if not self.refresh_interval_s >= MIN_REFRESH_INTERVAL_S:  # `not >=`: NaN is refused too
            raise ValueError(
                f"auth.jwt.refresh_interval_s must be at least {MIN_REFRESH_INTERVAL_S:g} s (it rate-limits "
                f"the key set fetches that tokens with unknown `kid`s cause), got {self.refresh_interval_s!r}"
            )
        if self.max_age_s < self.refresh_interval_s:
            raise ValueError("max_age_s must be >= refresh_interval_s")


class AuthSpec(SpecBase):
    #: JWT / OIDC bearer tokens accepted beside API keys; null: API keys only
    jwt: JwtSpec | None = None


class InvalidToken(Unauthenticated):
    """A bearer token that is not accepted; `code` names the reason class (`token_expired`, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = f"token_{reason}"


def looks_like_jwt(raw: str) -> bool:
    """Whether a credential has a JWT's shape: three dot-separated parts, the first a JSON header
    naming an `alg`. API keys (`fg-<id>-<secret>`) never contain a dot."""
    return raw.count(".") == 2 and unverified_header(raw) is not None


def unverified_header(raw: str) -> dict[str, Any] | None:
    """A token's header, decoded but not trusted (None when it is not base64url JSON).

    Read here rather than with `jwt.get_unverified_header`, which decodes and checks every segment
    character by character in Python (~130 us for an RS256 token on the bench machine, more than
    everything else a remembered token costs); `jwt.decode` checks all of it strictly afterwards.
    """
    segment = raw.partition(".")[0]
    try:
        header = msgspec.json.decode(base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4)))
    except (ValueError, binascii.Error, msgspec.DecodeError, RecursionError):
        # RecursionError: a header of a few thousand nested brackets (a 3 kB token) exceeds the
        # decoder's depth; it is a malformed token like any other, not a server error
        return None
    return header if isinstance(header, dict) and "alg" in header else None


# PyJWT's exceptions, most specific first, -> (reason class, message). The messages are ours: a
# library's text could quote what it was given.
_REFUSALS: tuple[tuple[type[jwt.PyJWTError], str, str], ...] = (
    (jwt.InvalidSignatureError, "bad_signature", "token signature does not verify"),
    (jwt.InvalidIssuerError, "wrong_issuer", "token issuer is not the configured issuer"),
    (jwt.InvalidAudienceError, "wrong_audience", "token audience is not the configured audience"),
    (jwt.MissingRequiredClaimError, "missing_claim", "token lacks a required claim (exp, iss, aud)"),
    (jwt.InvalidAlgorithmError, "algorithm_not_allowed", "token algorithm does not match its key"),
    (jwt.InvalidKeyError, "algorithm_not_allowed", "token algorithm does not match its key"),
    (jwt.PyJWKError, "unknown_key", "the issuer's key for this token cannot be used"),
    (jwt.DecodeError, "malformed", "malformed token"),
    (jwt.PyJWTError, "invalid", "invalid token"),
)


#: PyJWT checks signature, iss, aud and that exp is there; exp and nbf are compared by
#: `JwtVerifier._check_times` against the injected clock (also for tokens it remembers)
_DECODE_OPTIONS: Any = {
    "require": ["exp", "iss", "aud"],
    "verify_exp": False,
    "verify_nbf": False,
    "verify_iat": False,
}


class JwtVerifier:
    """Bearer tokens -> `Principal`: signature against the issuer's JWKS, issuer, audience,
    expiry and not-before with leeway, the tenant claim against the configured tenants.

    Args:
        spec: the `auth.jwt` section.
        clock: epoch seconds now (injected so tests move time).
        tenants: names of the configured tenants; update with `update_tenants` on reload.
        fetch: GETs the JWKS URL (tests count calls); an httpx GET by default.
    """

    def __init__(
        self,
        spec: JwtSpec,
        clock: Callable[[], float] = time.time,
        *,
        tenants: Collection[str] = (),
        fetch: Callable[[str], Awaitable[bytes]] | None = None,
    ) -> None:
        self.spec = spec
        self._clock = clock
        self._tenants = frozenset(tenants)
        self._algorithms = frozenset(spec.algorithms)
        get = fetch or (lambda url: fetch_url(url, spec.fetch_timeout_s))
        self.keys = KeyRing(spec.jwks_url, clock, spec.refresh_interval_s, spec.max_age_s, get)
        #: token -> (key set generation, exp, nbf, principal): tokens already verified
        self._verified: OrderedDict[str, tuple[int, float, float | None, Principal]] = OrderedDict()
        self._prepared: dict[tuple[str, str], jwt.PyJWK] = {}
        self._prepared_generation = 0

    def update_tenants(self, tenants: Collection[str]) -> None:
        """Replace the set of configured tenants (config reload)."""
        self._tenants = frozenset(tenants)

    def recognizes(self, raw: str) -> bool:
        """Whether `raw` is a token for this verifier rather than an API key: one it verified
        before (a dictionary lookup), or one of a JWT's shape."""
        return raw in self._verified or looks_like_jwt(raw)

    async def authenticate(self, raw: str) -> Principal:
        """The Principal of a bearer token.

        Raises:
            InvalidToken: the token is refused (401; `code` names why, the message never quotes it).
        """
        seen = self._verified.get(raw)
        if seen is not None and seen[0] == self.keys.generation:
            generation, exp, nbf, principal = seen
            self._check_times(exp, nbf)
            self._check_tenant(principal.tenant)
            return principal
        header = _header(raw)
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self._algorithms:
            raise InvalidToken("algorithm_not_allowed", f"token algorithm {_safe(alg)} is not allowed")
        kid = header.get("kid")
        if not isinstance(kid, str):
            raise InvalidToken("unknown_key", "token names no signing key (`kid`)")
        jwk = await self.keys.key(kid)
        if jwk is None:
            raise InvalidToken("unknown_key", "token is signed by a key the issuer does not publish")
        claims = self._decode(raw, self._prepare(kid, alg, jwk), alg)
        exp, nbf = _number(claims, "exp"), _number(claims, "nbf") if "nbf" in claims else None
        self._check_times(exp, nbf)
        principal = self._principal(claims)
        self._remember(raw, exp, nbf, principal)
        return principal

    def _prepare(self, kid: str, alg: str, jwk: dict[str, Any]) -> jwt.PyJWK:
        """The JWK bound to `alg`, made once per key set (building it parses the key)."""
        if self._prepared_generation != self.keys.generation:
            self._prepared = {}
            self._prepared_generation = self.keys.generation
        prepared = self._prepared.get((kid, alg))
        if prepared is None:
            declared = jwk.get("alg")
            if declared is not None and declared != alg:
                raise InvalidToken("algorithm_not_allowed", f"token algorithm {_safe(alg)} is not its key's")
            try:
                prepared = jwt.PyJWK(jwk, algorithm=alg)
            except jwt.PyJWTError:
                raise InvalidToken("algorithm_not_allowed", "token algorithm does not match its key") from None
            self._prepared[(kid, alg)] = prepared
        return prepared

    def _decode(self, raw: str, key: jwt.PyJWK, alg: str) -> dict[str, Any]:
        spec = self.spec
        try:
            return jwt.decode(
                raw,
                key,
                algorithms=[alg],
                audience=spec.audience,
                issuer=spec.issuer,
                options=_DECODE_OPTIONS,
            )
        except jwt.PyJWTError as exc:
            for kind, reason, message in _REFUSALS:
                if isinstance(exc, kind):
                    raise InvalidToken(reason, message) from None
            raise  # unreachable: PyJWTError is the last row

    def _check_times(self, exp: float, nbf: float | None) -> None:
        now = self._clock()
        if now > exp + self.spec.leeway_s:
            raise InvalidToken("expired", "token has expired")
        if nbf is not None and now < nbf - self.spec.leeway_s:
            raise InvalidToken("not_yet_valid", "token is not valid yet (nbf)")

    def _check_tenant(self, tenant: str) -> None:
        if tenant not in self._tenants:
            raise InvalidToken("unknown_tenant", "token names a tenant that is not configured")

    def _principal(self, claims: Mapping[str, Any]) -> Principal:
        tenant = claims.get(self.spec.tenant_claim)
        if not isinstance(tenant, str):
            claim = self.spec.tenant_claim
            raise InvalidToken("missing_claim", f"token's tenant claim {claim!r} is missing or not a string")
        self._check_tenant(tenant)
        if self.spec.subject_claim is None:
            return Principal(tenant, TENANT_SUBJECT)
        subject = claims.get(self.spec.subject_claim)
        if not isinstance(subject, str) or not subject:
            claim = self.spec.subject_claim
            raise InvalidToken("missing_claim", f"token's subject claim {claim!r} is missing, empty or not a string")
        if len(subject) > MAX_SUBJECT:
            # the subject becomes a key id: in every store key, usage row and log line of its requests
            raise InvalidToken("malformed", f"token's subject is longer than {MAX_SUBJECT} characters")
        return Principal(tenant, SUBJECT_PREFIX + subject)

    def _remember(self, raw: str, exp: float, nbf: float | None, principal: Principal) -> None:
        self._verified[raw] = (self.keys.generation, exp, nbf, principal)
        if len(self._verified) > _MAX_VERIFIED:
            self._verified.popitem(last=False)


def _header(raw: str) -> dict[str, Any]:
    header = unverified_header(raw)
    if header is None:
        raise InvalidToken("malformed", "malformed token")
    return header


def _number(claims: Mapping[str, Any], name: str) -> float:
    value = claims.get(name)
    # not finite: PyJWT's json.loads reads NaN and Infinity, and an `exp` of NaN compares false
    # with every time (a token that never expires)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidToken("malformed", f"token claim {name!r} is not a finite number")
    return float(value)


def _safe(alg: object) -> str:
    """An algorithm name fit to repeat (it comes from the token: bounded, printable, else elided)."""
    if isinstance(alg, str) and len(alg) <= 16 and alg.isprintable():
        return repr(alg)
    return "(unreadable)"


def jwt_verifier(
    auth: AuthSpec,
    clock: Callable[[], float],
    tenants: Collection[str],
    fetch: Callable[[str], Awaitable[bytes]] | None = None,
) -> JwtVerifier | None:
    """The verifier of `auth.jwt`, or None when tokens are not configured."""
    return None if auth.jwt is None else JwtVerifier(auth.jwt, clock, tenants=tenants, fetch=fetch)
