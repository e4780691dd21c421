"""Whether a runtime call runs on the event loop's own thread or is handed to a worker thread.

A worker thread keeps a slow run from stalling every other request, but the hand-off is not free:
a future, a wake-up of the loop through its self-pipe, and the GIL passed back and forth. For a small
model that costs more than the run itself. Measured on the digits MLP (ONNX Runtime, about 15 us a
run), one gateway each way in one run, HTTP v2: running inline took the gateway's CPU per request
from 1.19 to 0.85 ms at c=1 and from 1.07 to 0.83 ms at c=16 (1.18x the requests/s), and p50 at c=1
from 1.24 to 0.93 ms.

So a call with small inputs (at most `max_bytes`) runs inline while recent inline runs of such calls
took less than `below_s`. The estimate is the median of the last `window` inline runs, so one run
stretched by the machine (preemption, a collection) does not move it; runs on workers are not
counted, since a worker's run time includes its wait for the GIL when it returns, which says more
about the loop's load than about the model. A deployment's first inline run is not counted either:
it pays the runtime's lazy initialisation (digits on ONNX Runtime: 0.79 ms, against 15 us after).
A model measured slower runs on workers; while it is within 4x of the bound, one small call in
`probe_every` runs inline to measure again, and a model measured slower than that is never run
inline again (its inline run would hold up every other request for that long). Calls with larger
inputs always go to a worker and never change the estimate.
"""

from __future__ import annotations

import statistics
from collections import deque

#: inputs larger than this always run on a worker thread (and never inform the estimate)
DEFAULT_MAX_BYTES = 64 * 1024
#: while runs go to workers, every this-many small calls one runs inline to measure again
DEFAULT_PROBE_EVERY = 256
#: inline runs the estimate is the median of
DEFAULT_WINDOW = 16


class InlineRuns:
    """The decision for one deployment's runtime calls; used from the event loop's thread only."""

    def __init__(
        self,
        below_s: float,
        max_bytes: int = DEFAULT_MAX_BYTES,
        probe_every: int = DEFAULT_PROBE_EVERY,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        self.below_s = below_s
        self.max_bytes = max_bytes
        self.probe_every = probe_every
        self.estimate_s: float | None = None  # median duration of recent inline runs
        self._recent: deque[float] = deque(maxlen=window)
        self._first_seen = False
        self.inline_calls = 0  # counted for tests and metrics
        self.worker_calls = 0
        self._since_probe = 0

    def run_inline(self, input_bytes: int) -> bool:
        """Whether the call about to be made, with inputs of `input_bytes`, runs on the loop's thread."""
        inline = self._decide(input_bytes)
        if inline:
            self.inline_calls += 1
        else:
            self.worker_calls += 1
        return inline

    def _decide(self, input_bytes: int) -> bool:
        if self.below_s <= 0 or input_bytes > self.max_bytes:
            return False
        estimate = self.estimate_s
        if estimate is None or estimate < self.below_s:
            return True
        if estimate < 4 * self.below_s:
            self._since_probe += 1
            if self._since_probe >= self.probe_every:
                self._since_probe = 0
                return True
        return False

    def record(self, seconds: float) -> None:
        """The duration of an inline run that succeeded (the first one is not counted)."""
        if not self._first_seen:
            self._first_seen = True
            return
        self._recent.append(seconds)
        self.estimate_s = statistics.median(self._recent)
