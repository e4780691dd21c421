"""The issuer's JSON Web Key Set: fetched over HTTP (httpx), kept by `kid`, fetched again on an
unknown `kid` at most once per interval (concurrent callers share one fetch), and refreshed in the
background once old. Used by the JWT verifier (policies/jwt_auth.py); no network while a key is held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import msgspec
import structlog

log = structlog.get_logger(__name__)


#: the most a key set may weigh: an issuer's JWKS holds a few keys (a few kB); anything near this
#: is not one, and reading it whole would let a broken or hostile endpoint fill the gateway's memory
MAX_JWKS_BYTES = 1 << 20


async def fetch_url(url: str, timeout_s: float) -> bytes:
    """GET `url` (the key set) within `timeout_s` in all; raises on a transport error, a non-2xx
    answer, a body over `MAX_JWKS_BYTES` or the time running out.

    httpx's own timeout bounds each read, not the whole answer: an endpoint that drips a byte a
    second would hold every request waiting for the key set, so the whole fetch runs under one
    deadline, and the body is read in chunks so its size is checked before it is all in memory.
    """
    async with asyncio.timeout(timeout_s):
        async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False) as client:
            async with client.stream("GET", url, headers={"accept": "application/json"}) as response:
                response.raise_for_status()
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_JWKS_BYTES:
                        raise ValueError(f"the key set is larger than {MAX_JWKS_BYTES} bytes")
                return bytes(body)


class KeyRing:
    """The issuer's signing keys by `kid`, fetched on demand and at most once per interval.

    Args:
        url: the JWKS URL.
        clock: seconds now (injected so tests move time).
        refresh_interval_s: least time between two fetches.
        max_age_s: a key set this old is fetched again in the background.
        fetch: GETs the URL (tests may count calls); `fetch_url` by default.
    """

    def __init__(
        self,
        url: str,
        clock: Callable[[], float],
        refresh_interval_s: float,
        max_age_s: float,
        fetch: Callable[[str], Awaitable[bytes]],
    ) -> None:
        self._url = url
        self._clock = clock
        self._interval = refresh_interval_s
        self._max_age = max_age_s
        self._fetch = fetch
        self._keys: dict[str, dict[str, Any]] = {}
        self._fetched_at: float | None = None  # last attempt, successful or not
        self._loaded_at: float | None = None  # last success
        self._inflight: asyncio.Future[None] | None = None
        #: bumped whenever the key set changes (verified tokens of a retired key are forgotten)
        self.generation = 0
        #: fetches made (successful or not), for metrics and tests
        self.fetches = 0

    async def key(self, kid: str) -> dict[str, Any] | None:
        """The JWK named `kid`; an unknown one fetches the set again, unless the last fetch was
        less than `refresh_interval_s` ago (then None at once). Concurrent callers share one fetch."""
        found = self._keys.get(kid)
        now = self._clock()
        if found is not None:
            if self._loaded_at is not None and now - self._loaded_at >= self._max_age:
                self._start_refresh(now)  # the cached key still answers meanwhile
            return found
        if self._inflight is None and self._fetched_at is not None and now - self._fetched_at < self._interval:
            return None
        await asyncio.shield(self._start_refresh(now))
        return self._keys.get(kid)

    def _start_refresh(self, now: float) -> asyncio.Future[None]:
        if self._inflight is None:
            if self._fetched_at is not None and now - self._fetched_at < self._interval:
                done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                done.set_result(None)
                return done
            self._fetched_at = now
            self._inflight = asyncio.ensure_future(self._refresh())
            self._inflight.add_done_callback(self._refreshed)
        return self._inflight

    def _refreshed(self, task: asyncio.Future[None]) -> None:
        self._inflight = None

    async def _refresh(self) -> None:
        self.fetches += 1
        try:
            body = await self._fetch(self._url)
            keys = _parse_jwks(body)
        except Exception as exc:  # noqa: BLE001 - the old keys stay; tokens of unknown kids are refused
            log.warning("jwks_fetch_failed", url=_shown(self._url), error=_reason(exc))
            return
        if keys != self._keys:
            self._keys = keys
            self.generation += 1
            # a few kids: a set of thousands (each up to the body's size) is not one log line
            log.info("jwks_loaded", url=_shown(self._url), keys=len(keys), kids=sorted(keys)[:10])
        self._loaded_at = self._clock()


def _parse_jwks(body: bytes) -> dict[str, dict[str, Any]]:
    """`kid` -> JWK of a key set's signing keys (keys without a `kid`, or for encryption, skipped)."""
    document = msgspec.json.decode(body)
    if not isinstance(document, dict) or not isinstance(document.get("keys"), list):
        raise ValueError("not a JWKS document (no `keys` list)")
    out: dict[str, dict[str, Any]] = {}
    for key in document["keys"]:
        if isinstance(key, dict) and isinstance(key.get("kid"), str) and key.get("use", "sig") == "sig":
            out[key["kid"]] = key
    return out


def _shown(url: str) -> str:
    """The URL fit for a log line: without user:password or query (where a credential could sit)."""
    parsed = httpx.URL(url)
    return str(parsed.copy_with(userinfo=b"", query=None, fragment=None))


def _reason(exc: BaseException) -> str:
    """Why a fetch failed, in words that quote neither the URL (httpx's status error does) nor
    the body."""
    if isinstance(exc, httpx.HTTPStatusError):
        return f"HTTP {exc.response.status_code}"
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return "timed out"
    if isinstance(exc, httpx.HTTPError):
        return type(exc).__name__
    return f"{type(exc).__name__}: {str(exc)[:200]}"
