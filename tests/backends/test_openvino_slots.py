"""OpenVINO's slot count: a slot handed over just as a waiter's poll timed out stays the waiter's."""

from __future__ import annotations

import asyncio

import pytest

from backends.openvino import slots as slots_module
from backends.openvino.slots import Slots


async def test_slot_handed_over_as_the_poll_times_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The poll's timeout and `release` race: release pops the waiter and resolves it, then the
    poll reports its timeout. The waiter owns the slot (the deque is empty by then)."""
    slots = Slots(1)
    await slots.acquire(lambda: False)  # the one slot is taken
    real_wait_for = asyncio.wait_for

    async def release_then_time_out(future: asyncio.Future, timeout: float) -> None:
        future.cancel()  # the shield only: the waiter itself stays pending until release
        slots.release()  # hands the slot to the waiter, popping it from the queue
        raise TimeoutError

    monkeypatch.setattr(slots_module.asyncio, "wait_for", release_then_time_out)
    await slots.acquire(lambda: False)  # raised IndexError on an empty waiter queue before
    monkeypatch.setattr(slots_module.asyncio, "wait_for", real_wait_for)
    assert slots.free == 0 and not slots._waiters
    slots.release()
    assert slots.free == 1
