"""How `fleetgate pull` shows downloads: a bar per file on a terminal, a line every few seconds
otherwise (a container's log)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import IO, Any

from backends.sources.download import Progress


class TerminalProgress:
    """One tqdm bar per file, bytes scaled (kB, MB, GB)."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._bar: Any = None

    def begin(self, label: str, total: int | None, done: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=total, initial=done, desc=label, unit="B", unit_scale=True, unit_divisor=1024,
            file=self._stream, leave=True, dynamic_ncols=True,
        )

    def advance(self, n: int) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def end(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class LineProgress:
    """A line per file when it starts and ends, and one every `every_s` seconds while it runs,
    handed to `show` (a log stream for `fleetgate pull`, a deployment's readiness detail)."""

    def __init__(self, show: Callable[[str], None], every_s: float = 10.0) -> None:
        self._show = show
        self._every_s = every_s
        self._label = ""
        self._total: int | None = None
        self._done = 0
        self._last = 0.0

    def _line(self, what: str) -> None:
        total = f" of {self._total / 1e6:.1f} MB" if self._total is not None else " MB"
        share = f" ({100 * self._done / self._total:.0f}%)" if self._total else ""
        self._show(f"{what} {self._label}: {self._done / 1e6:.1f}{total}{share}")

    def begin(self, label: str, total: int | None, done: int) -> None:
        self._label, self._total, self._done = label, total, done
        self._last = time.monotonic()
        self._line("resuming" if done else "fetching")

    def advance(self, n: int) -> None:
        self._done += n
        if time.monotonic() - self._last >= self._every_s:
            self._last = time.monotonic()
            self._line("fetching")

    def end(self) -> None:
        self._line("done")


def progress_for(stream: IO[str]) -> Progress:
    """Bars when `stream` is a terminal, periodic lines otherwise."""
    if stream.isatty():
        return TerminalProgress(stream)

    def show(line: str) -> None:
        stream.write(f"fleetgate pull: {line}\n")
        stream.flush()

    return LineProgress(show)
