"""Whether a runtime call runs on the event loop's own thread or is handed to the runtime's threads.

A worker thread keeps a slow run from stalling every other request, but the hand-off is not free:
a future, a wake-up of the loop through its self-pipe, and the GIL passed back and forth. For a small
model that costs more than the run itself. Measured on the digits MLP (ONNX Runtime, about 15 us a
run), two gateways side by side (`bench/bench_inline_runs.py`, 5 rounds): running inline gave 1.33x
the requests/s over HTTP at 16 in flight (gateway CPU per request 0.69x) and 1.46x over gRPC; at 1 in
flight this machine's noise (0.54-1.8x a round) hid any difference.

The rule: a call runs inline only when
- the deployment runs on a CPU (a GPU run waits for the device, and a new shape can start a kernel
  search or compile that takes far longer than any run measured before: the backend passes 0),
- its inputs are at most `max_bytes` and hold no strings (whose size an array does not show),
- at least `min_runs` runs have been measured since the first (which pays the runtime's lazy
  initialisation: digits on ONNX Runtime 0.79 ms, against 15 us after, and is not counted),
- the median of the last `window` runs is under `below_s`, and none of them took over `stall_factor`
  times that: one slow run (a larger input, a machine hiccup) moves calls back to workers until it
  has left the window, so a model whose cost depends on its input does not stall the loop twice in a
  row on the strength of a fast median.
A call that runs alone (nothing else running or queued on its deployment, no batch forming: the
batcher's lone path, `backends/runtime/batcher.py`, so only with batching on) may run inline under a second,
larger bound: the median of the window under `alone_below_s`, no run in it over twice that, and the
call's inputs no larger than the largest measured in it (so a 32-row call after one-row runs, which
may cost 32 times more, goes to a worker).
Nothing of the deployment is left to overlap with such a call, so the hand-off to a worker would
only add its wake-ups to the caller's latency: on the heavy MLP of `bench/bench_tensor_peers.py`
(about 3 ms a run), `bench/bench_lone_inline.py` measured one caller's p50 at 0.88x with the rule on
against off (5 rounds, 0.85-0.97x), and 2, 4, 8 and 32 callers at 1.06, 0.98, 1.04 and 1.00x the
requests/s (one run of a 3 ms model already keeps both cores here, so two callers taking turns on
the loop lose nothing). The batcher treats a request as lone only once callers have come one at a
time for a while (`SEQUENTIAL_RUNS`). The price: the loop is held for the run, so a request
arriving meanwhile, for any deployment, waits up to about twice `alone_below_s`; 0 turns it off.
The bound on the slowest run is 2x, not `stall_factor`, because this bound is already
milliseconds; with "every run under the bound" instead, a 3 ms model whose runs here reach 5 ms at
p99 went inline only about half the time.

Every run of a small call counts, wherever it ran: inline runs by their time on the loop; on ONNX
Runtime, worker runs by their wall time in the worker, which also holds the worker's wait for the
GIL when the run returns, so under load they read slower than they are and keep calls on workers
(the safe side; inline runs, once started, measure the model alone); on OpenVINO, queued runs by
the runtime's own latency figure. Calls run on workers until the estimate allows otherwise, so a
model is never run inline before it has been seen to be fast.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping

import numpy as np

#: inputs larger than this always run on a worker thread
DEFAULT_MAX_BYTES = 64 * 1024
#: runs the estimate is taken over
DEFAULT_WINDOW = 16
#: runs measured (after the first) before any call runs inline
DEFAULT_MIN_RUNS = 3
#: a run in the window slower than this many times the bound keeps calls on workers
DEFAULT_STALL_FACTOR = 8.0
#: the same for calls alone, whose bound is already milliseconds: the longest the loop may stall
ALONE_STALL_FACTOR = 2.0


def call_bytes(inputs: Mapping[str, np.ndarray]) -> int | None:
    """The bytes of a call's inputs, or None when one holds objects (strings): their size is unknown."""
    total = 0
    for array in inputs.values():
        if array.dtype == object:
            return None
        total += array.nbytes
    return total


class InlineRuns:
    """The decision for one deployment's runtime calls; used from the event loop's thread only."""

    def __init__(
        self,
        below_s: float,
        max_bytes: int = DEFAULT_MAX_BYTES,
        window: int = DEFAULT_WINDOW,
        min_runs: int = DEFAULT_MIN_RUNS,
        stall_factor: float = DEFAULT_STALL_FACTOR,
        alone_below_s: float = 0.0,
    ) -> None:
        self.below_s = below_s
        self.alone_below_s = alone_below_s
        self.max_bytes = max_bytes
        self.min_runs = min_runs
        self.stall_factor = stall_factor
        self.estimate_s: float | None = None  # median of the recent runs
        self.inline_calls = 0  # counted for tests and metrics
        self.worker_calls = 0
        self._recent: deque[float] = deque(maxlen=window)
        self._recent_bytes: deque[int] = deque(maxlen=window)  # the inputs of those runs
        self._first_seen = False

    @classmethod
    def from_options(cls, inline_below_us: int, inline_alone_below_us: int, on_cpu: bool) -> InlineRuns:
        """A backend's rule from its `inline_below_us` / `inline_alone_below_us` options: off (both
        bounds 0) unless the runtime runs on a CPU (a GPU run waits for the device, and a new
        shape may start a kernel search or compile far longer than any run measured before)."""
        if not on_cpu:
            return cls(0)
        return cls(inline_below_us / 1e6, alone_below_s=inline_alone_below_us / 1e6)

    def run_inline(self, input_bytes: int | None, available: bool = True, alone: bool = False) -> bool:
        """Whether the call about to be made, with inputs of `input_bytes` (`call_bytes`), runs on
        the loop's thread (`available`: whether the backend can run it there at all; `alone`:
        nothing else of the deployment runs or waits)."""
        inline = available and self._decide(input_bytes, alone)
        if inline:
            self.inline_calls += 1
        else:
            self.worker_calls += 1
        return inline

    def is_small(self, input_bytes: int | None) -> bool:
        """Whether a call of `input_bytes` could ever run inline, so its run time informs the estimate."""
        return input_bytes is not None and input_bytes <= self.max_bytes

    def _decide(self, input_bytes: int | None, alone: bool) -> bool:
        recent = self._recent
        if not self.is_small(input_bytes) or len(recent) < self.min_runs or self.estimate_s is None:
            return False
        slowest = max(recent)
        if 0 < self.below_s and self.estimate_s < self.below_s and slowest < self.stall_factor * self.below_s:
            return True
        # a lone call: a larger bound, and inputs no larger than those measured (64 rows after
        # one-row runs may cost 64 times more)
        return (
            alone
            and self.estimate_s < self.alone_below_s
            and slowest < ALONE_STALL_FACTOR * self.alone_below_s
            and input_bytes <= max(self._recent_bytes)
        )

    def record(self, seconds: float, input_bytes: int) -> None:
        """The cost of one run that succeeded, inline or on a worker, and its inputs' bytes (the
        first run is not counted)."""
        if not self._first_seen:
            self._first_seen = True
            return
        self._recent.append(seconds)
        self._recent_bytes.append(input_bytes)
        self.estimate_s = statistics.median(self._recent)
