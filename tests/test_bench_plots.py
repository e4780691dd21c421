"""bench/plots.py: a result JSON becomes a PNG with the date and machine on it, and a redraw of a
picture kept as is adds that footer once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"

plots = pytest.importorskip("bench.plots", reason="bench/plots.py needs matplotlib (the dev extra)")
from bench.plotting import STAMP_KEY, is_stamped  # noqa: E402


def _stamp(path: Path) -> str:
    from PIL import Image

    with Image.open(path) as image:
        return image.info[STAMP_KEY]


def test_a_result_is_drawn_with_its_date_and_machine(tmp_path):
    result = tmp_path / "gateway.json"
    shutil.copy(BENCH / "results" / "gateway.json", result)
    assert plots.redraw(result) == "drawn"
    png = tmp_path / "gateway.png"
    stamp = _stamp(png)
    cpus = json.loads(result.read_text())["machine"]["cpus"]
    assert "gateway.json · measured 20" in stamp and f"{cpus} cores" in stamp


def test_a_picture_without_its_data_gets_the_footer_once(tmp_path):
    import matplotlib.pyplot as plt

    shutil.copy(BENCH / "results" / "embeddings.json", tmp_path / "embeddings.json")
    png = tmp_path / "embeddings.png"
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.bar(["a", "b"], [1, 2])
    fig.savefig(png)  # as the script drew it, before plots had footers
    plt.close(fig)
    assert not is_stamped(png)
    assert plots.redraw(tmp_path / "embeddings.json") == "footer added"
    assert is_stamped(png) and "embeddings.json · measured" in _stamp(png)
    assert plots.redraw(tmp_path / "embeddings.json") == "already has its footer"
