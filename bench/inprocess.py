"""Measuring the gateway's CPU a request inside one process, without the network.

Shared by the in-process benches (`bench_tracing_inprocess.py`, `bench_deadline_inprocess.py`): the
gateway app (the one `fleetgate serve` runs, started with its lifespan) is called directly as an
ASGI app, one request at a time, so no client, socket or HTTP parser shares the CPU or the
measurement. A bench switches the app between states (tracing on or off, one implementation or
another) and `run_rounds` visits every state in every round, in a balanced Latin square's order.
Rounds are short and many, so the machine's drift, slow next to a round, cancels in each round's
difference between two states; `paired` gives the median of those differences with a bootstrap 95 %
interval.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.bench_tracing import williams_order


async def call(app: Any, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    """One POST through the ASGI app, as uvicorn would hand it over."""
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000), "scheme": "http",
        "method": "POST", "root_path": "", "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": [(b"host", b"127.0.0.1:8000"), (b"content-length", str(len(body)).encode()), *headers],
        "state": {},
    }  # fmt: skip
    delivered = False
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def start_app(app: Any) -> Callable[[], Awaitable[None]]:
    """Run the app's lifespan startup; returns the coroutine function that shuts it down."""
    startup: asyncio.Queue = asyncio.Queue()
    answers: asyncio.Queue = asyncio.Queue()
    await startup.put({"type": "lifespan.startup"})
    lifespan = asyncio.ensure_future(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, startup.get, answers.put)
    )
    started = await answers.get()
    if started["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"the gateway did not start: {started}")

    async def shutdown() -> None:
        await startup.put({"type": "lifespan.shutdown"})
        await asyncio.wait_for(lifespan, 60)

    return shutdown


async def run_rounds(
    states: list[str],
    switch: Callable[[str], None],
    request: Callable[[], Awaitable[None]],
    rounds: int,
    requests: int,
) -> list[dict]:
    """Every round visits every state (`switch`) and serves `requests` requests in each; per state,
    the process's CPU a request (every thread) and the event loop thread's, in microseconds."""
    measured = []
    for index in range(rounds):
        result = {}
        for state in williams_order(states, index):
            switch(state)
            for _ in range(3):  # the switch's own first requests stay out
                await request()
            cpu0, loop0 = time.process_time(), time.thread_time()
            for _ in range(requests):
                await request()
            result[state] = {
                "cpu_us_per_request": (time.process_time() - cpu0) / requests * 1e6,
                "loop_thread_us_per_request": (time.thread_time() - loop0) / requests * 1e6,
            }
        measured.append(result)
        if index % 50 == 49:
            print(f"round {index + 1}/{rounds}", flush=True)
    return measured


def median_interval(values: list[float], draws: int = 2000) -> tuple[float, float]:
    """A bootstrap 95 % interval of the median of `values` (resampled with a fixed seed)."""
    rng = random.Random(1)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws)]


def paired(rounds: list[dict], state: str, baseline: str, key: str = "cpu_us_per_request") -> dict:
    """`state` against `baseline`: the median of the rounds' differences, its 95 % interval, and
    both as a ratio to the baseline's median."""
    base = statistics.median(r[baseline][key] for r in rounds)
    differences = [r[state][key] - r[baseline][key] for r in rounds]
    low, high = median_interval(differences)
    difference = statistics.median(differences)
    return {
        "difference_us": difference,
        "difference_us_95": [low, high],
        "ratio": 1 + difference / base,
        "ratio_95": [1 + low / base, 1 + high / base],
    }
