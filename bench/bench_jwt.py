"""What a JWT bearer token costs over an API key, through a running gateway at c=1, and in process.

Gateway: `fleetgate serve` (a subprocess; state memory://, no limits, no deployments) with `auth.jwt`
trusting a JWKS served by this script on loopback (RS256, 2048-bit key). One keep-alive connection
sends `GET /v1/models` (the identify step and a small answer, nothing else) with, in turn, the API key,
one reused token (the usual client: a token lives minutes to hours) and a token never seen before
(each request a new `jti`: the full signature check). The three are interleaved request by request,
so drift on a shared machine hits them alike; "added p50" = p50(token) - p50(API key) per round, the
median over rounds reported. The JWKS is fetched once, at the first token, before the timing.

In process: `Identity.authenticate` alone for each kind (memory store), microseconds per call.

    .venv/bin/python -m bench.bench_jwt [--requests 2000 --rounds 5]

Writes bench/results/jwt.json and bench/results/jwt.png. Target (issue 45): at most 0.05 ms added p50
with a cached JWKS.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import platform
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

from bench.bench_gateway import RESULTS, start_gateway
from bench.plotting import figure, grouped_bars, save

ISSUER = "https://issuer.bench"
AUDIENCE = "fleetgate"
KINDS = ("api_key", "token_reused", "token_new")


class Issuer:
    """One RS256 signing key and its JWKS, served on a loopback port by a thread."""

    def __init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        self.jwks = json.dumps({"keys": [{**public, "kid": "bench-1", "use": "sig", "alg": "RS256"}]}).encode()
        self.fetches = 0
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the standard library's name
                issuer.fetches += 1
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(issuer.jwks)))
                self.end_headers()
                self.wfile.write(issuer.jwks)

            def log_message(self, *_: Any) -> None:
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/.well-known/jwks.json"

    def token(self, jti: str) -> str:
        now = time.time()
        claims = {"iss": ISSUER, "aud": AUDIENCE, "exp": now + 3600, "tenant": "bench", "sub": "svc", "jti": jti}
        return jwt.encode(claims, self.key, algorithm="RS256", headers={"kid": "bench-1"})


def _config(jwks_url: str) -> Any:
    def make(port: int) -> str:
        return f"""
server: {{port: {port}, log_level: warning}}
state: {{url: "memory://"}}
auth: {{jwt: {{issuer: "{ISSUER}", audience: {AUDIENCE}, jwks_url: "{jwks_url}", algorithms: [RS256]}}}}
tenants:
  bench: {{}}
"""

    return make


def _get(conn: http.client.HTTPConnection, credential: str) -> float:
    start = time.perf_counter()
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {credential}"})
    response = conn.getresponse()
    response.read()
    elapsed = time.perf_counter() - start
    if response.status != 200:
        raise RuntimeError(f"GET /v1/models answered {response.status}")
    return elapsed * 1000


def _p50(values: list[float]) -> float:
    return statistics.median(values)


def through_gateway(issuer: Issuer, requests: int, rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        proc, port, api_key = start_gateway(Path(tmp), _config(issuer.url))
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port)
            reused = issuer.token("reused")
            for _ in range(300):  # warm-up: connection, caches, the JWKS fetch
                _get(conn, api_key)
                _get(conn, reused)
            per_round = []
            for r in range(rounds):
                fresh = [issuer.token(f"{r}-{i}") for i in range(requests)]
                samples: dict[str, list[float]] = {k: [] for k in KINDS}
                for i in range(requests):
                    samples["api_key"].append(_get(conn, api_key))
                    samples["token_reused"].append(_get(conn, reused))
                    samples["token_new"].append(_get(conn, fresh[i]))
                p50 = {k: _p50(v) for k, v in samples.items()}
                per_round.append(
                    {
                        "p50_ms": p50,
                        "p99_ms": {k: sorted(v)[int(0.99 * len(v)) - 1] for k, v in samples.items()},
                        "added_p50_ms": {k: p50[k] - p50["api_key"] for k in KINDS[1:]},
                    }
                )
            conn.close()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {
        "requests_per_kind_per_round": requests,
        "rounds": per_round,
        "median_p50_ms": {k: _p50([r["p50_ms"][k] for r in per_round]) for k in KINDS},
        "median_added_p50_ms": {k: _p50([r["added_p50_ms"][k] for r in per_round]) for k in KINDS[1:]},
        "jwks_fetches": issuer.fetches,
    }


def in_process(issuer: Issuer, calls: int) -> dict[str, float]:
    """Microseconds per `Identity.authenticate` call of each kind (memory store, cached key record)."""
    from policies.identity import Identity
    from policies.jwt_auth import AuthSpec, JwtSpec
    from policies.keys import KeyService
    from policies.stores import open_store

    async def run() -> dict[str, float]:
        store = await open_store("memory://")
        keys = KeyService(store, time.time, tenants=["bench"])
        _, api_key = await keys.create("bench")
        spec = JwtSpec(issuer=ISSUER, audience=AUDIENCE, jwks_url=issuer.url)
        identity = Identity(keys, AuthSpec(jwt=spec), ["bench"])
        reused = issuer.token("reused")
        fresh = [issuer.token(f"in-{i}") for i in range(calls)]
        await identity.authenticate(reused)  # the JWKS fetch, outside the timing
        out = {}
        for kind, credentials in (("api_key", [api_key] * calls), ("token_reused", [reused] * calls), ("token_new", fresh)):
            start = time.perf_counter()
            for credential in credentials:
                await identity.authenticate(credential)
            out[kind] = (time.perf_counter() - start) / calls * 1e6
        await keys.uses_written()
        await store.close()
        return out

    return asyncio.run(run())


def plot(result: dict[str, Any], path: Path) -> None:
    gateway, local = result["gateway"], result["in_process_us"]
    fig, (left, right) = figure(1, 2, (11, 4.2))
    labels = ["API key", "token (reused)", "token (new each time)"]
    grouped_bars(left, labels, {"p50 ms": [gateway["median_p50_ms"][k] for k in KINDS]}, fmt="{:.3f}")
    added = gateway["median_added_p50_ms"]
    left.set_title(
        f"GET /v1/models at c=1, p50 (added: reused {added['token_reused']:+.3f} ms, new {added['token_new']:+.3f} ms)"
    )
    left.set_ylabel("ms")
    grouped_bars(right, labels, {"µs per call": [local[k] for k in KINDS]}, fmt="{:.1f}")
    right.set_title("Identity.authenticate in process (µs)")
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    issuer = Issuer()
    result = {
        "bench": "jwt",
        "machine": {"python": platform.python_version(), "processor": platform.processor() or platform.machine()},
        "target": "JWT check adds at most 0.05 ms p50 over an API key at c=1 with a cached JWKS",
        "gateway": through_gateway(issuer, args.requests, args.rounds),
        "in_process_us": in_process(issuer, 2000),
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "jwt.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, RESULTS / "jwt.png")
    print(json.dumps({"gateway": result["gateway"]["median_added_p50_ms"], "in_process_us": result["in_process_us"]}))


if __name__ == "__main__":
    main()
