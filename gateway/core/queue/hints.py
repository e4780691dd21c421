"""What a caller may ask of the fair queue per request: a priority and a deadline, from headers.

- `x-fleetgate-priority`: `interactive` (1), `normal` (0, the default), `batch` (-1), or an integer
  in -100..100. It orders requests *inside* the tenant's own queue only: a tenant cannot buy a larger
  share of the deployment with it.
- `x-fleetgate-deadline-ms`: how long the request may wait in the queue (positive, at most one
  day). One that has not reached the backend by then is answered 504 and never dispatched. The
  earlier of this and the deployment's `queue.default_deadline_s` applies.

A malformed value is the caller's mistake (400), answered in the caller's protocol.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import msgspec

from backends.errors import InvalidInput

PRIORITY_HEADER = "x-fleetgate-priority"
DEADLINE_HEADER = "x-fleetgate-deadline-ms"
PRIORITY_NAMES = {"interactive": 1, "normal": 0, "batch": -1}
MAX_PRIORITY = 100
MAX_DEADLINE_MS = 86_400_000.0


class QueueHints(msgspec.Struct, frozen=True):
    """Per-request queue parameters (see the module docstring)."""

    priority: int = 0
    #: seconds the request may wait for its turn; None: the deployment's default
    timeout_s: float | None = None
    #: wait in the fair queue's background class (batch jobs; never from a header): dispatched only
    #: into capacity that no interactive request is waiting for
    background: bool = False


NO_HINTS = QueueHints()
BACKGROUND_HINTS = QueueHints(background=True)


def queue_hints(headers: Mapping[str, str]) -> QueueHints:
    """The hints in lower-cased request `headers`.

    Raises:
        InvalidInput: a header is present but not a valid value.
    """
    raw_priority = headers.get(PRIORITY_HEADER)
    raw_deadline = headers.get(DEADLINE_HEADER)
    if raw_priority is None and raw_deadline is None:
        return NO_HINTS
    return QueueHints(priority=_priority(raw_priority), timeout_s=_timeout_s(raw_deadline))


def _priority(raw: str | None) -> int:
    if raw is None:
        return 0
    value = raw.strip().lower()
    if value in PRIORITY_NAMES:
        return PRIORITY_NAMES[value]
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or not -MAX_PRIORITY <= number <= MAX_PRIORITY:
        raise InvalidInput(
            f"{PRIORITY_HEADER} must be interactive, normal, batch or an integer in "
            f"-{MAX_PRIORITY}..{MAX_PRIORITY}, got {raw[:40]!r}"
        )
    return number


def _timeout_s(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        ms = float(raw.strip())
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and 0 < ms <= MAX_DEADLINE_MS):
        raise InvalidInput(
            f"{DEADLINE_HEADER} must be a positive number of milliseconds up to {MAX_DEADLINE_MS:.0f}, "
            f"got {raw[:40]!r}"
        )
    return ms / 1000.0
