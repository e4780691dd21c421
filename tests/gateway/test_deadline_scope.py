"""`Deadline.scope()`: asyncio.timeout_at's rules, its expiry as the 504, nothing left armed after it."""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop

from fleetgate.errors import GatewayError
from gateway.core.deadline import Deadline


def run(coro):  # noqa: ANN001, ANN201 - the gateway's loop
    return uvloop.run(coro)


def test_work_past_the_deadline_ends_with_the_504() -> None:
    async def main() -> float:
        deadline = Deadline(0.05, time.perf_counter())
        started = time.perf_counter()
        with pytest.raises(GatewayError) as raised:
            async with deadline.scope():
                await asyncio.sleep(5)
        assert raised.value.status == 504 and "0.05 s" in raised.value.message
        assert asyncio.current_task().cancelling() == 0  # the task's own cancel was taken back
        return time.perf_counter() - started

    assert run(main()) < 1.0


def test_a_deadline_already_past_cancels_at_the_first_await() -> None:
    async def main() -> list[str]:
        deadline = Deadline(0.01, time.perf_counter() - 1.0)
        reached = []
        with pytest.raises(GatewayError):
            async with deadline.scope():
                reached.append("before")
                await asyncio.sleep(0)
                reached.append("after")
        return reached

    assert run(main()) == ["before"]


def test_a_scope_that_ended_in_time_leaves_no_timer_behind() -> None:
    async def main() -> str:
        deadline = Deadline(0.05, time.perf_counter())
        for _ in range(3):  # sequential scopes of one request, as the core runs them
            async with deadline.scope():
                await asyncio.sleep(0)
        await asyncio.sleep(0.15)  # past the deadline, outside any scope: nothing cancels this
        return "finished"

    assert run(main()) == "finished"


def test_another_cancellation_stays_a_cancellation_even_when_the_deadline_also_passed() -> None:
    async def body(deadline: Deadline, entered: asyncio.Event) -> None:
        async with deadline.scope():
            entered.set()
            try:
                await asyncio.sleep(5)
            finally:
                await asyncio.sleep(0.1)  # the deadline passes while the client's cancel is handled

    async def main() -> None:
        deadline = Deadline(0.05, time.perf_counter())
        entered = asyncio.Event()
        task = asyncio.ensure_future(body(deadline, entered))
        await entered.wait()
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())


def test_an_error_inside_the_scope_passes_through_unchanged() -> None:
    async def main() -> None:
        deadline = Deadline(5.0, time.perf_counter())
        with pytest.raises(KeyError):
            async with deadline.scope():
                raise KeyError("the body's own error")

    run(main())
