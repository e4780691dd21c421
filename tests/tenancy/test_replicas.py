"""Two gateway processes sharing one real redis-server: limits and revocation hold across replicas."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from tests.tenancy.conftest import (
    ADMIN_HEADERS,
    GatewayProcess,
    admin_create_key,
    bearer,
    deployments_yaml,
    gateway_processes,
    models_yaml,
    v2_body,
    write_config,
)

log = logging.getLogger(__name__)

LIMIT = 100  # requests per minute: the bucket refills one slot every 0.6 s
BURST = 500


@pytest.fixture(scope="module")
def replicas(
    digits,  # type: ignore[no-untyped-def]
    upstream_url: str,
    redis_url: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[GatewayProcess]]:
    work = tmp_path_factory.mktemp("replicas")
    # A key prefix of its own: other tests of the session may use the same redis-server.
    state = f"{redis_url}?prefix=tenancy{uuid.uuid4().hex[:8]}:"
    text = f"""
server: {{drain_grace_s: 0}}
state: {{url: "{state}"}}
tenants:
  burst: {{models: ["digits"], limits: {{requests_per_minute: {LIMIT}}}}}
  free: {{models: ["digits"]}}
{deployments_yaml(digits, upstream_url)}
{models_yaml(["digits"], [])}
"""
    config = write_config(work / "fleetgate.yaml", text)
    # Two processes, one config file: that is how replicas are deployed.
    with gateway_processes([config, config], work) as gws:
        yield gws


async def _burst(urls: list[str], key: str, n: int) -> tuple[Counter[tuple[int, int]], float]:
    """Fire `n` requests at once, alternating replicas; (replica index, status) counts and seconds."""
    body = v2_body()
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(limits=limits, timeout=60) as client:

        async def one(i: int) -> tuple[int, int]:
            url = urls[i % len(urls)]
            r = await client.post(f"{url}/v2/models/digits/infer", json=body, headers=bearer(key))
            if r.status_code == 429:
                assert "retry-after" in r.headers and "x-ratelimit-remaining-requests" in r.headers
            return i % len(urls), r.status_code

        t0 = time.monotonic()
        statuses = await asyncio.gather(*(one(i) for i in range(n)))
        return Counter(statuses), time.monotonic() - t0


def test_burst_across_two_replicas_admits_the_limit(replicas: list[GatewayProcess]) -> None:
    a, b = replicas
    key, _ = admin_create_key(a.url, "burst")
    per_replica, elapsed = asyncio.run(_burst([a.url, b.url], key, BURST))
    counts = Counter[int]()
    for (_, status), n in per_replica.items():
        counts[status] += n
    admitted, refused = counts[200], counts[429]
    refill = math.floor(elapsed * LIMIT / 60.0)
    log.warning(
        "replica burst: %d admitted, %d refused of %d in %.2f s (refill allowance %d), per replica %s",
        admitted,
        refused,
        BURST,
        elapsed,
        refill,
        dict(per_replica),
    )
    assert admitted + refused == BURST, counts
    # The bucket starts full with LIMIT slots and refills one per 0.6 s while the burst runs; a limit
    # multiplied by the number of replicas would admit up to 2 * LIMIT.
    assert LIMIT <= admitted <= LIMIT + refill, (admitted, elapsed)
    # Both replicas answered their half; which one admitted more depends on scheduling only.
    for replica in (0, 1):
        assert per_replica[(replica, 200)] + per_replica[(replica, 429)] == BURST // 2, per_replica
    usage = httpx.get(f"{a.url}/admin/usage", params={"tenant": "burst"}, headers=ADMIN_HEADERS).json()
    days = [r for r in usage["usage"] if len(r["period"]) == 10]
    assert sum(r["requests"] for r in days) == admitted


def test_revocation_on_one_replica_reaches_the_other_within_one_second(
    replicas: list[GatewayProcess],
) -> None:
    a, b = replicas
    key, key_id = admin_create_key(a.url, "free")

    def infer(url: str) -> int:
        return httpx.post(f"{url}/v2/models/digits/infer", json=v2_body(), headers=bearer(key)).status_code

    assert infer(b.url) == 200  # replica b has the key's record cached now
    assert httpx.delete(f"{a.url}/admin/keys/{key_id}", headers=ADMIN_HEADERS).status_code == 200
    t0 = time.monotonic()
    while (status := infer(b.url)) != 401:
        assert status == 200
        assert time.monotonic() - t0 < 1.0, "replica b still served a revoked key after 1 s"
        time.sleep(0.02)
    log.warning("revocation reached the other replica after %.3f s", time.monotonic() - t0)
    assert infer(a.url) == 401
