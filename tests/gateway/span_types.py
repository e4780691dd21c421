"""Running tracing tests with spans made by the C module (`fleetgate/span_native.h`, where a C
compiler builds it) and with the Python `Span` (what a gateway without a compiler runs)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from fleetgate import otlp_native, tracing


@contextmanager
def spans_of(kind: str, patch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Gateways started inside make spans of `kind` ("c" or "python"); yields the C module or None.

    "python" sets the switch an operator has (`FLEETGATE_OTLP_NATIVE=0`); "c" skips the test where
    the module does not build. The module cache is cleared around it so each kind loads afresh.
    """
    if kind == "python":
        patch.setenv("FLEETGATE_OTLP_NATIVE", "0")
    otlp_native.load.cache_clear()
    module = otlp_native.load()
    if kind == "c" and module is None:
        pytest.skip("the C module does not build here (no compiler or headers): the Python spans serve")
    try:
        yield module
    finally:
        otlp_native.load.cache_clear()


@pytest.fixture(params=["c", "python"])
def span_type(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Gateways started in the test make spans of this type; so does a test's own `tracing.enable`."""
    with spans_of(request.param, monkeypatch) as module:
        if module is not None:
            plain = tracing.enable

            def enable(sink: Any, sample_ratio: float = 1.0, native: Any = None, queue: Any = None) -> None:
                plain(sink, sample_ratio, native=native or module, queue=queue)

            monkeypatch.setattr(tracing, "enable", enable)
        yield request.param
