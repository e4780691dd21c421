"""The benchmarks' one plotting helper: every PNG says when and on what machine its numbers were taken.

`save(fig, path)` writes `path` with a footer naming the script's result, the date of the
measurement and the machine, read from the JSON beside the PNG (`x.png` <- `x.json`, written just
before): its `machine` section, and as the date today when the JSON is new or changed, or else the
date git recorded it (a plot redrawn from an old result keeps that result's date, not today's).
The footer is also stored in the PNG's text metadata, so `bench/plots.py` never stamps a PNG twice.
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a benchmark machine
import matplotlib.pyplot as plt  # noqa: E402

from fleetgate.host import cpu_model  # noqa: E402

STAMP_KEY = "fleetgate-stamp"
ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def measured_on(result: Path) -> tuple[str, bool]:
    """The date (UTC) of the numbers in `result`, and whether they are fresh (new or changed since
    git recorded them: today's run on this machine) or an older result (git's date for it)."""
    try:
        changed = _git("status", "--porcelain", "--", str(result))
        committed = _git("log", "-1", "--format=%cs", "--", str(result))
    except (OSError, subprocess.CalledProcessError):  # not in a git checkout: the file's own time
        return datetime.fromtimestamp(result.stat().st_mtime, UTC).strftime("%Y-%m-%d"), True
    if changed or not committed:
        return datetime.now(UTC).strftime("%Y-%m-%d"), True
    return committed, False


def _recorded_machine(data: Any) -> dict[str, Any]:
    """The machine facts a result recorded, wherever its script put them (`machine`, `setup`, top level)."""
    if not isinstance(data, dict):
        return {}
    facts: dict[str, Any] = {k: data[k] for k in ("cores", "cpus", "cpu_count", "gpu") if k in data}
    setup = data.get("setup") if isinstance(data.get("setup"), dict) else {}
    facts.update({k: setup[k] for k in ("gpu", "cpu") if k in setup})
    machine = data.get("machine", setup.get("machine"))
    if isinstance(machine, dict):
        facts.update(machine)
    elif machine:
        facts["description"] = str(machine)
    return facts


def describe_machine(machine: dict[str, Any], fresh: bool) -> str:
    """One line for the machine: what the result recorded, or this host where a fresh run recorded nothing."""
    cores = machine.get("cpus") or machine.get("cores") or machine.get("cpu_count")
    parts = [
        machine.get("description"),
        machine.get("cpu"),
        f"{cores} cores" if cores else None,
        machine.get("gpu"),
    ]
    if fresh and not machine.get("cpu") and not machine.get("description"):
        parts[1:3] = [cpu_model(), f"{cores or os.cpu_count()} cores"]
    text = ", ".join(str(p) for p in parts if p)
    return text or "machine not recorded in the result"


def stamp_text(path: Path) -> str:
    """The footer for the PNG at `path`, from the JSON beside it."""
    result = path.with_suffix(".json")
    if not result.exists():
        return f"{path.stem} · {datetime.now(UTC):%Y-%m-%d} · {describe_machine({}, fresh=True)}"
    try:
        data = json.loads(result.read_text())
    except ValueError:
        data = {}
    date, fresh = measured_on(result)
    machine = _recorded_machine(data)
    shown = result.resolve().relative_to(ROOT) if result.resolve().is_relative_to(ROOT) else result.name
    return f"{shown} · measured {date} · {describe_machine(machine, fresh)}"


def save(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Write `fig` to `path` with the date-and-machine footer, and close it."""
    text = stamp_text(path)
    # below the figure's own area, so it never covers an axis label; the tight bounding box takes it in
    fig.text(0.995, -0.01, text, ha="right", va="top", fontsize=7, color="#555")
    fig.savefig(path, dpi=dpi, metadata={STAMP_KEY: text}, bbox_inches="tight", pad_inches=0.15)
    plt.close(fig)
    return path


def is_stamped(path: Path) -> bool:
    """Whether the PNG at `path` already carries a footer (written by `save`)."""
    from PIL import Image

    with Image.open(path) as image:
        return STAMP_KEY in image.info


def grouped_bars(ax: Any, groups: list[str], series: dict[str, list[float]], *, fmt: str = "{:.0f}") -> None:
    """Bars of each series side by side in each group, with their values written on top."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, labels=[fmt.format(v) for v in values], fontsize=7, padding=1)
    ax.set_xticks(range(len(groups)), groups)
    ax.legend(fontsize=8)


def figure(rows: int = 1, cols: int = 1, size: tuple[float, float] = (10, 4.5)) -> tuple[Any, Any]:
    """A new figure (laid out tight when saved)."""
    return plt.subplots(rows, cols, figsize=size, layout="constrained")
