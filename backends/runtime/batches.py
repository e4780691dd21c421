"""One batch of the dynamic batcher: the queued requests it holds, merged along dimension 0, run
once and split back, each caller handed its own rows; a batch that fails is retried one request at
a time. `DynamicBatcher` (`batcher.py`) decides when and with whom a request runs; this is the run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import structlog

log = structlog.get_logger(__name__)

Arrays = dict[str, np.ndarray]
#: runs one (possibly merged) batch: inputs by name, requested output names (None = all)
RunBatch = Callable[[Arrays, tuple[str, ...] | None], Awaitable[Arrays]]


@dataclass
class Pending:
    """One queued request: its inputs, the outputs it asked for, its rows and its caller's future."""

    inputs: Arrays
    outputs: tuple[str, ...] | None
    rows: int
    future: asyncio.Future[Arrays]
    key: tuple = field(init=False)

    def __post_init__(self) -> None:
        # Requests with equal keys can be concatenated along dimension 0.
        sig = tuple(sorted((name, a.dtype.str, a.shape[1:]) for name, a in self.inputs.items()))
        self.key = (sig, self.outputs)


async def execute_batch(run: RunBatch, batch: list[Pending]) -> None:
    """Run `batch` as one merged call and hand each caller its rows; a failing batch is retried one
    request at a time, so a request the runtime rejects does not fail its batch-mates."""
    if len(batch) == 1:
        await run_single(run, batch[0])
        return
    names = list(batch[0].inputs)
    merged = {name: np.concatenate([p.inputs[name] for p in batch], axis=0) for name in names}
    try:
        outputs = await run(merged, batch[0].outputs)
    except Exception:  # noqa: BLE001 - isolate the failing request below
        log.warning("batch_failed_retrying_individually", size=len(batch))
        for pending in batch:
            await run_single(run, pending)
        return
    start = 0
    for pending in batch:
        stop = start + pending.rows
        if not pending.future.done():
            pending.future.set_result({name: value[start:stop] for name, value in outputs.items()})
        start = stop


async def run_single(run: RunBatch, pending: Pending) -> None:
    """Run one request alone; its result or its error goes to its caller."""
    try:
        result = await run(pending.inputs, pending.outputs)
    except Exception as exc:  # noqa: BLE001 - handed to the caller
        if not pending.future.done():
            pending.future.set_exception(exc)
        return
    if not pending.future.done():
        pending.future.set_result(result)
