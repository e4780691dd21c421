"""QueueSpec: defaults, validation that names the field, strict decoding from config."""

from __future__ import annotations

import msgspec
import pytest

from policies.fair_queue import QueueSpec


def test_defaults() -> None:
    spec = QueueSpec()
    assert (spec.policy, spec.max_concurrency, spec.max_queue_per_tenant, spec.max_queue_total) == (
        "vtc",
        4,
        256,
        4096,
    )
    # vtc_burst None: the gateway picks it per deployment (tests/gateway/test_queue_defaults.py)
    assert spec.default_deadline_s is None and spec.drr_quantum > 0 and spec.vtc_burst is None


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"policy": "wfq"}, "policy"),
        ({"max_concurrency": 0}, "max_concurrency"),
        ({"max_queue_per_tenant": 0}, "max_queue_per_tenant"),
        ({"max_queue_total": 0}, "max_queue_total"),
        ({"default_deadline_s": 0.0}, "default_deadline_s"),
        ({"drr_quantum": -1.0}, "drr_quantum"),
        ({"drr_quantum": float("nan")}, "drr_quantum"),
        ({"vtc_burst": -1.0}, "vtc_burst"),
        ({"vtc_burst": float("inf")}, "vtc_burst"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        QueueSpec(**kwargs)


def test_decodes_from_config_and_rejects_unknown_keys() -> None:
    spec = msgspec.convert({"policy": "drr", "max_concurrency": 8, "drr_quantum": 4}, QueueSpec)
    assert spec.policy == "drr" and spec.max_concurrency == 8 and spec.drr_quantum == 4.0
    with pytest.raises(msgspec.ValidationError, match="max_concurency"):
        msgspec.convert({"max_concurency": 8}, QueueSpec)
    with pytest.raises(msgspec.ValidationError, match="max_concurrency"):
        msgspec.convert({"max_concurrency": 0}, QueueSpec)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"policy": "lifo"}, QueueSpec)
    with pytest.raises(AttributeError):
        spec.policy = "fcfs"  # type: ignore[misc]
