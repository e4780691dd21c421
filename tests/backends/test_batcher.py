"""The dynamic batcher merges concurrent requests and isolates failures."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from backends.errors import BackendUnavailable
from backends.runtime.batcher import SEQUENTIAL_RUNS, DynamicBatcher


class Recorder:
    """A real computation (x * 2 per row) that records the batches it was given."""

    def __init__(self, poison: float | None = None) -> None:
        self.batches: list[int] = []
        self.poison = poison

    async def __call__(self, inputs, outputs):  # type: ignore[no-untyped-def]
        x = inputs["x"]
        self.batches.append(x.shape[0])
        if self.poison is not None and (x == self.poison).any():
            raise ValueError("poisoned row")
        await asyncio.sleep(0.001)
        return {"y": x * 2}


async def test_concurrent_requests_are_merged_and_split_back():
    run = Recorder()
    batcher = DynamicBatcher(run, max_batch_size=64, max_delay_ms=20, max_queue=100)
    xs = [np.full((2, 3), i, np.float32) for i in range(10)]
    results = await asyncio.gather(*(batcher.submit({"x": x}, None) for x in xs))
    for x, r in zip(xs, results, strict=True):
        np.testing.assert_array_equal(r["y"], x * 2)
    assert run.batches == [20]
    await batcher.close()


async def test_batch_size_cap_is_respected():
    run = Recorder()
    batcher = DynamicBatcher(run, max_batch_size=4, max_delay_ms=20, max_queue=100)
    await asyncio.gather(*(batcher.submit({"x": np.zeros((1, 2), np.float32)}, None) for _ in range(10)))
    assert max(run.batches) <= 4 and sum(run.batches) == 10
    await batcher.close()


async def test_incompatible_shapes_are_not_merged():
    run = Recorder()
    batcher = DynamicBatcher(run, max_batch_size=64, max_delay_ms=20, max_queue=100)
    a, b = np.zeros((1, 2), np.float32), np.zeros((1, 5), np.float32)
    ra, rb = await asyncio.gather(batcher.submit({"x": a}, None), batcher.submit({"x": b}, None))
    assert ra["y"].shape == (1, 2) and rb["y"].shape == (1, 5)
    assert sorted(run.batches) == [1, 1]
    await batcher.close()


async def test_a_failing_request_does_not_fail_its_batch_mates():
    run = Recorder(poison=-1.0)
    batcher = DynamicBatcher(run, max_batch_size=64, max_delay_ms=20, max_queue=100)
    good = [batcher.submit({"x": np.full((1, 2), i, np.float32)}, None) for i in range(3)]
    bad = batcher.submit({"x": np.full((1, 2), -1.0, np.float32)}, None)
    results = await asyncio.gather(*good, bad, return_exceptions=True)
    assert all(isinstance(r, dict) for r in results[:3])
    assert isinstance(results[3], ValueError)
    await batcher.close()


async def test_full_queue_is_refused():
    run = Recorder()
    batcher = DynamicBatcher(run, max_batch_size=2, max_delay_ms=50, max_queue=2)
    first = [
        asyncio.ensure_future(batcher.submit({"x": np.zeros((1, 1), np.float32)}, None)) for _ in range(2)
    ]
    await asyncio.sleep(0)
    with pytest.raises(BackendUnavailable, match="queue"):
        await batcher.submit({"x": np.zeros((1, 1), np.float32)}, None)
    await asyncio.gather(*first)
    await batcher.close()


async def test_cancelled_request_is_dropped():
    run = Recorder()
    batcher = DynamicBatcher(run, max_batch_size=64, max_delay_ms=30, max_queue=10)
    # a merged batch of three first, so the next batch waits (up to 30 ms) for three requests
    await asyncio.gather(*(batcher.submit({"x": np.zeros((1, 1), np.float32)}, None) for _ in range(3)))
    gone = asyncio.ensure_future(batcher.submit({"x": np.zeros((1, 1), np.float32)}, None))
    kept = asyncio.ensure_future(batcher.submit({"x": np.ones((1, 1), np.float32)}, None))
    await asyncio.sleep(0.005)
    gone.cancel()
    result = await kept
    np.testing.assert_array_equal(result["y"], np.full((1, 1), 2.0))
    assert run.batches == [3, 1]
    await batcher.close()


class Overlap:
    """A slow real computation that records how many runs overlapped at most."""

    def __init__(self, delay_s: float = 0.02, poison: float | None = None) -> None:
        self.delay_s = delay_s
        self.poison = poison
        self.running = 0
        self.most = 0
        self.batches: list[int] = []

    async def __call__(self, inputs, outputs):  # type: ignore[no-untyped-def]
        x = inputs["x"]
        self.batches.append(x.shape[0])
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(self.delay_s)
            if self.poison is not None and (x == self.poison).any():
                raise ValueError("poisoned row")
            return {"y": x + 1}
        finally:
            self.running -= 1


@pytest.mark.parametrize("slots", [1, 3])
async def test_batches_in_flight_never_exceed_the_slots(slots: int) -> None:
    run = Overlap()
    batcher = DynamicBatcher(run, max_batch_size=1, max_delay_ms=0, max_queue=100, max_in_flight=slots)
    xs = [np.full((1, 2), i, np.float32) for i in range(9)]
    results = await asyncio.gather(*(batcher.submit({"x": x}, None) for x in xs))
    for x, r in zip(xs, results, strict=True):
        np.testing.assert_array_equal(r["y"], x + 1)
    assert run.most == slots
    assert batcher.in_flight == 0
    await batcher.close()


async def test_requests_arriving_while_every_slot_is_busy_merge_into_the_next_batch() -> None:
    run = Overlap(delay_s=0.03)
    batcher = DynamicBatcher(run, max_batch_size=64, max_delay_ms=0, max_queue=100, max_in_flight=2)
    first = [asyncio.ensure_future(batcher.submit({"x": np.zeros((1, 2), np.float32)}, None))]
    await asyncio.sleep(0.005)
    first.append(asyncio.ensure_future(batcher.submit({"x": np.zeros((1, 5), np.float32)}, None)))
    await asyncio.sleep(0.005)  # both slots busy now
    later = [batcher.submit({"x": np.full((1, 2), i, np.float32)}, None) for i in range(6)]
    await asyncio.gather(*first, *later)
    assert run.batches == [1, 1, 6]
    await batcher.close()


async def test_a_failing_batch_does_not_fail_its_mates_or_the_other_slots() -> None:
    run = Overlap(delay_s=0.01, poison=-1.0)
    batcher = DynamicBatcher(run, max_batch_size=4, max_delay_ms=5, max_queue=100, max_in_flight=2)
    xs = [np.full((1, 2), float(i), np.float32) for i in range(11)] + [np.full((1, 2), -1.0, np.float32)]
    results = await asyncio.gather(*(batcher.submit({"x": x}, None) for x in xs), return_exceptions=True)
    for x, r in zip(xs[:-1], results[:-1], strict=True):
        np.testing.assert_array_equal(r["y"], x + 1)
    assert isinstance(results[-1], ValueError)
    assert run.most == 2
    await batcher.close()


async def test_close_answers_callers_of_running_batches() -> None:
    run = Overlap(delay_s=5.0)
    batcher = DynamicBatcher(run, max_batch_size=1, max_delay_ms=0, max_queue=100, max_in_flight=2)
    calls = [
        asyncio.ensure_future(batcher.submit({"x": np.zeros((1, 1), np.float32)}, None)) for _ in range(3)
    ]
    await asyncio.sleep(0.01)
    assert batcher.in_flight == 2 and batcher.depth == 1
    await batcher.close()
    results = await asyncio.gather(*calls, return_exceptions=True)
    assert all(isinstance(r, BackendUnavailable) for r in results)


async def test_requests_queued_together_are_shared_out_over_the_free_slots() -> None:
    # Closed-loop callers come back all at once; one big batch would idle the other slots.
    run = Overlap(delay_s=0.02)
    # max_delay_ms far above the run time, so a wait would show on a loaded machine too
    batcher = DynamicBatcher(run, max_batch_size=256, max_delay_ms=1000, max_queue=100, max_in_flight=2)
    xs = [np.full((1, 2), i, np.float32) for i in range(16)]
    started = asyncio.get_running_loop().time()
    results = await asyncio.gather(*(batcher.submit({"x": x}, None) for x in xs))
    for x, r in zip(xs, results, strict=True):
        np.testing.assert_array_equal(r["y"], x + 1)
    assert run.batches == [8, 8]
    assert run.most == 2
    # both halves started at once: no max_delay_ms wait before the second one
    assert asyncio.get_running_loop().time() - started < 0.5
    await batcher.close()


async def test_the_wait_for_company_ends_when_the_last_batch_s_callers_are_back() -> None:
    run = Overlap(delay_s=0.005)
    batcher = DynamicBatcher(run, max_batch_size=256, max_delay_ms=2000, max_queue=100)

    async def caller(i: int) -> None:  # closed loop: resubmits as soon as its answer is in
        for _ in range(3):
            await batcher.submit({"x": np.full((1, 1), i, np.float32)}, None)

    started = asyncio.get_running_loop().time()
    await asyncio.gather(*(caller(i) for i in range(4)))
    assert run.batches == [4, 4, 4]
    assert asyncio.get_running_loop().time() - started < 1.0  # not 2 x 2 s of waiting
    await batcher.close()


class Gated:
    """x * 2 per row; each batch waits for the test to open its gate, so overlap is exact."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.gate = asyncio.Event()

    async def __call__(self, inputs, outputs):  # type: ignore[no-untyped-def]
        self.batches.append(inputs["x"].shape[0])
        await self.gate.wait()
        return {"y": inputs["x"] * 2}


async def test_continuous_mode_runs_an_idle_request_at_once_and_merges_what_arrives_while_busy():
    run = Gated()
    # a delay far above the test's run time: waiting on the timer even once would show
    batcher = DynamicBatcher(
        run, max_batch_size=64, max_delay_ms=5_000, max_queue=100, wait_for_company=False
    )
    first = asyncio.ensure_future(batcher.submit({"x": np.ones((1, 2), np.float32)}, None))
    await asyncio.sleep(0.05)
    assert run.batches == [1]  # the runtime was idle: it started without waiting for company
    later = [
        asyncio.ensure_future(batcher.submit({"x": np.full((1, 2), i, np.float32)}, None)) for i in range(5)
    ]
    await asyncio.sleep(0.05)
    assert run.batches == [1]  # the runtime is busy: they gather
    run.gate.set()
    results = await asyncio.wait_for(asyncio.gather(first, *later), timeout=2.0)
    assert run.batches == [1, 5]  # one merged batch as soon as the slot freed, no timer
    np.testing.assert_array_equal(results[3]["y"], np.full((1, 2), 4.0))
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(batcher.submit({"x": np.ones((1, 2), np.float32)}, None), timeout=2.0)
    # a lone request after a merged batch: the delay mode would wait up to 5 s for company here
    assert asyncio.get_running_loop().time() - started < 2.0 and run.batches == [1, 5, 1]
    await batcher.close()


async def test_delay_mode_does_not_make_a_request_after_a_burst_wait_for_company():
    run = Gated()
    run.gate.set()
    batcher = DynamicBatcher(run, max_batch_size=64, max_delay_ms=400, max_queue=100)
    await asyncio.gather(*(batcher.submit({"x": np.ones((1, 2), np.float32)}, None) for _ in range(5)))
    assert run.batches == [5]
    await asyncio.sleep(0.6)  # the burst is over: its callers are not coming back
    run.gate.clear()
    lone = asyncio.ensure_future(batcher.submit({"x": np.ones((1, 2), np.float32)}, None))
    await asyncio.sleep(0.1)
    assert run.batches == [5, 1]  # started at once, not after waiting 400 ms for company
    run.gate.set()
    await lone
    await batcher.close()


async def test_a_lone_request_runs_in_its_callers_task_through_run_alone() -> None:
    batched, alone = Recorder(), Recorder()
    batcher = DynamicBatcher(batched, max_batch_size=64, max_delay_ms=20, max_queue=100, run_alone=alone)
    for i in range(SEQUENTIAL_RUNS + 3):
        result = await batcher.submit({"x": np.full((1, 2), i, np.float32)}, None)
        np.testing.assert_array_equal(result["y"], np.full((1, 2), 2.0 * i))
    # callers came one at a time: after SEQUENTIAL_RUNS lone batches, through run_alone
    assert batched.batches == [1] * SEQUENTIAL_RUNS and alone.batches == [1, 1, 1]
    assert batcher._task is None  # no hand-off to the batcher's task was needed
    # requests that arrive together still merge: the first yields once and finds company
    await asyncio.gather(*(batcher.submit({"x": np.ones((1, 2), np.float32)}, None) for _ in range(4)))
    assert batched.batches[-1] == 4 and alone.batches == [1, 1, 1]
    # and callers that overlapped take SEQUENTIAL_RUNS lone batches again before run_alone
    for _ in range(SEQUENTIAL_RUNS):
        await batcher.submit({"x": np.ones((1, 2), np.float32)}, None)
    assert alone.batches == [1, 1, 1]
    await batcher.submit({"x": np.ones((1, 2), np.float32)}, None)
    assert alone.batches == [1, 1, 1, 1]
    await batcher.close()


async def _sequential(batcher: DynamicBatcher) -> None:
    """Enough lone requests one after another that the next lone one goes through run_alone."""
    for _ in range(SEQUENTIAL_RUNS):
        await batcher.submit({"x": np.zeros((1, 2), np.float32)}, None)


async def test_a_lone_run_holds_its_slot_and_what_arrives_meanwhile_merges_after_it() -> None:
    alone, batched = Gated(), Recorder()
    batcher = DynamicBatcher(batched, max_batch_size=64, max_delay_ms=5, max_queue=100, run_alone=alone)
    await _sequential(batcher)
    lone = asyncio.ensure_future(batcher.submit({"x": np.ones((1, 2), np.float32)}, None))
    await asyncio.sleep(0.02)
    assert alone.batches == [1] and batcher.in_flight == 1
    later = [
        asyncio.ensure_future(batcher.submit({"x": np.full((1, 2), i, np.float32)}, None)) for i in range(3)
    ]
    await asyncio.sleep(0.02)
    assert len(batched.batches) == SEQUENTIAL_RUNS and batcher.depth == 3  # the slot is held
    alone.gate.set()
    results = await asyncio.wait_for(asyncio.gather(lone, *later), timeout=2.0)
    assert batched.batches[SEQUENTIAL_RUNS:] == [3] and batcher.in_flight == 0
    np.testing.assert_array_equal(results[3]["y"], np.full((1, 2), 4.0))
    await batcher.close()


async def test_callers_returning_from_a_merged_batch_do_not_take_the_lone_path() -> None:
    # the continuous mode starts a request at once when a slot is free, but right after a merged
    # batch its mates are on their way back: it runs through `run`, not run_alone
    batched, alone = Recorder(), Recorder()
    batcher = DynamicBatcher(
        batched, max_batch_size=64, max_delay_ms=300, max_queue=100, wait_for_company=False, run_alone=alone
    )
    await _sequential(batcher)
    await asyncio.gather(*(batcher.submit({"x": np.ones((1, 2), np.float32)}, None) for _ in range(3)))
    await batcher.submit({"x": np.ones((1, 2), np.float32)}, None)
    assert batched.batches[SEQUENTIAL_RUNS:] == [3, 1] and alone.batches == []
    await _sequential(batcher)  # callers one at a time again: run_alone after enough of them
    assert alone.batches == [1]
    await batcher.close()


async def test_callers_that_answer_slowly_after_a_merged_batch_still_come_back_as_one() -> None:
    # A merged batch's callers resume one after another, each answering its client (here 8 ms of
    # blocking work) before the next runs, and their clients' next requests arrive one by one after
    # the last answer, longer than max_delay after the run ended. Counted from the run's end, the
    # first request back found the runtime idle and ran alone, and so did each after it: [4, 1, 1, 1, 1]
    # (on a large model a run of one row costs nearly what a full batch does). Counted from the last
    # caller's resumption, they merge again.
    run = Recorder()
    batcher = DynamicBatcher(run, max_batch_size=64, max_delay_ms=20, max_queue=100, max_in_flight=1)
    loop = asyncio.get_running_loop()
    answering_s, arrival_gap_s = 0.008, 0.002
    first_resumed: list[float] = []

    async def caller(i: int) -> None:
        result = await batcher.submit({"x": np.full((1, 2), i, np.float32)}, None)
        first_resumed.append(loop.time())
        time.sleep(answering_s)  # encoding and writing the answer hold the loop
        # the clients' next requests arrive after all four answered, a little apart
        await asyncio.sleep(first_resumed[0] + 4 * answering_s + i * arrival_gap_s - loop.time())
        result = await batcher.submit({"x": np.full((1, 2), i, np.float32)}, None)
        np.testing.assert_array_equal(result["y"], np.full((1, 2), 2.0 * i))

    await asyncio.wait_for(asyncio.gather(*(caller(i) for i in range(4))), timeout=2.0)
    assert run.batches == [4, 4]
    await batcher.close()


async def test_a_slot_is_free_when_its_callers_resume() -> None:
    # one slot: a caller that submits again as soon as its answer is in finds the slot free
    # and runs at once, rather than queueing behind a batch whose task has not ended yet
    run = Recorder()
    batcher = DynamicBatcher(run, max_batch_size=64, max_delay_ms=20, max_queue=100, max_in_flight=1)
    await asyncio.gather(*(batcher.submit({"x": np.ones((1, 2), np.float32)}, None) for _ in range(2)))
    # right after a merged batch company is expected: this one is queued and run by the batcher's
    # task (after waiting max_delay for company)
    await batcher.submit({"x": np.ones((1, 2), np.float32)}, None)
    assert batcher.in_flight == 0 and batcher._runs_at_once()
    assert run.batches == [2, 1]
    await batcher.close()


async def test_an_observer_that_raises_does_not_keep_the_slot() -> None:
    def observer(requests: int, rows: int) -> None:
        raise RuntimeError("metrics hook failed")

    batcher = DynamicBatcher(Recorder(), max_batch_size=64, max_delay_ms=5, max_queue=100, observer=observer)
    with pytest.raises(RuntimeError):
        await batcher.submit({"x": np.ones((1, 2), np.float32)}, None)
    assert batcher.in_flight == 0 and batcher._runs_at_once()
    await batcher.close()


async def test_a_closed_batcher_refuses_new_requests_and_lone_ones_in_flight_finish() -> None:
    alone = Gated()
    batcher = DynamicBatcher(Recorder(), max_batch_size=64, max_delay_ms=5, max_queue=100, run_alone=alone)
    await _sequential(batcher)
    lone = asyncio.ensure_future(batcher.submit({"x": np.ones((1, 2), np.float32)}, None))
    yielding = asyncio.ensure_future(asyncio.sleep(0.01))
    await yielding
    await batcher.close()
    with pytest.raises(BackendUnavailable, match="shutting down"):
        await batcher.submit({"x": np.ones((1, 2), np.float32)}, None)
    alone.gate.set()
    np.testing.assert_array_equal((await lone)["y"], np.full((1, 2), 2.0))  # its run finished


async def test_a_caller_cancelled_while_it_yields_leaves_nothing_behind() -> None:
    run = Recorder()
    batcher = DynamicBatcher(run, max_batch_size=64, max_delay_ms=5, max_queue=2)
    call = asyncio.ensure_future(batcher.submit({"x": np.ones((1, 2), np.float32)}, None))
    await asyncio.sleep(0)  # it runs up to its yield
    assert batcher._lone_candidate
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert not batcher._lone_candidate and batcher.in_flight == 0 and batcher.depth == 0
    result = await batcher.submit({"x": np.ones((1, 2), np.float32)}, None)  # still serves
    np.testing.assert_array_equal(result["y"], np.full((1, 2), 2.0))
    await batcher.close()


async def test_what_queues_while_a_request_yields_joins_it_even_when_the_task_wakes_first() -> None:
    # A lone run ends (waking the batcher's task) in the same loop pass as two requests arrive:
    # the first yields, the second queues, and the task, ready before the first resumes, must not
    # take the second alone.
    run = Gated()
    batcher = DynamicBatcher(run, max_batch_size=64, max_delay_ms=2, max_queue=100, wait_for_company=False)
    batcher.start()
    held = asyncio.ensure_future(batcher.submit({"x": np.ones((1, 1), np.float32)}, None))
    await asyncio.sleep(0.01)  # it runs at once, in its own task, and waits on the gate
    loop = asyncio.get_running_loop()
    pair: asyncio.Future = loop.create_future()

    def same_pass() -> None:
        run.gate.set()
        both = asyncio.gather(
            *(batcher.submit({"x": np.full((1, 1), 2.0, np.float32)}, None) for _ in range(2))
        )
        both.add_done_callback(lambda f: pair.set_result(f.result()))

    loop.call_soon(same_pass)
    await held
    await asyncio.wait_for(pair, timeout=2.0)
    assert run.batches == [1, 2]
    await batcher.close()
