"""A fixture that runs a tracing test twice: with spans made by the C module (`fleetgate/span_native.h`,
where a C compiler builds it) and with the Python `Span` (what a gateway without a compiler runs)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from fleetgate import otlp_native, tracing


@pytest.fixture(params=["c", "python"])
def span_type(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Gateways started in the test make spans of this type; so does a test's own `tracing.enable`."""
    if request.param == "python":
        monkeypatch.setenv("FLEETGATE_OTLP_NATIVE", "0")  # the switch an operator has
        otlp_native.load.cache_clear()
        yield "python"
        otlp_native.load.cache_clear()
        return
    module = otlp_native.load()
    if module is None:
        pytest.skip("the C module does not build here (no compiler or headers): the Python spans serve")
    plain = tracing.enable

    def enable(sink: Any, sample_ratio: float = 1.0, native: Any = None, queue: Any = None) -> None:
        plain(sink, sample_ratio, native=native or module, queue=queue)

    monkeypatch.setattr(tracing, "enable", enable)
    yield "c"
