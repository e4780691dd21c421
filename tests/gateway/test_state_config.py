"""The `state.leases` and `state.partition` config: defaults, and refusals that name the path."""

from __future__ import annotations

import msgspec
import pytest

from gateway.config.spec import StateConfig


def test_leases_on_by_default_and_partition_off() -> None:
    state = msgspec.convert({"url": "memory://"}, StateConfig)
    assert state.leases.strategy == "leases" and state.partition is None


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ({"leases": {"strategy": "sometimes"}}, "at `$.leases.strategy`"),
        ({"leases": {"flush_s": 0}}, "leases.flush_s must be positive"),
        ({"leases": {"max_share": 1.5}}, "leases.max_share must be in (0, 1]"),
        ({"partition": {"max_overspend_fraction": 2}}, "partition.max_overspend_fraction must be in [0, 1]"),
        ({"partition": {"max_seconds": -1}}, "partition.max_seconds must be positive"),
        ({"partition": {"max_second": 5}}, "unknown field `max_second`"),
    ],
)
def test_bad_lease_settings_are_refused_by_path(field: dict, message: str) -> None:
    with pytest.raises(msgspec.ValidationError) as exc:
        msgspec.convert({"url": "memory://", **field}, StateConfig)
    assert message in str(exc.value)
