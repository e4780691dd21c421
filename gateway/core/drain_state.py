"""Where a process is in its drain after SIGTERM: the core reads it (readiness, refusing new
calls); `fleetgate serve`'s DrainingServer (gateway/serve/drain.py) moves it on."""

from __future__ import annotations

import time


class DrainState:
    """Where the process is in its drain; the core reads it (readiness, refusing new calls)."""

    def __init__(self) -> None:
        self.draining = False
        self.refusing = False
        self.started_at: float | None = None

    def begin(self) -> None:
        self.draining = True
        self.started_at = time.monotonic()

    def refuse_new(self) -> None:
        self.refusing = True
