"""`auth.jwt.refresh_interval_s` below its floor is refused: it is the only rate limit on the JWKS
fetches that tokens with made-up `kid`s cause (policies/jwt_auth.py, MIN_REFRESH_INTERVAL_S)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError, parse_config


def _auth(refresh_interval_s: str) -> str:
    return (
        "auth: {jwt: {issuer: https://issuer.test, audience: fleetgate, "
        f"jwks_url: 'https://issuer.test/jwks', refresh_interval_s: {refresh_interval_s}}}}}\n"
    )


@pytest.mark.parametrize("value", ["0", "0.5", "-1", ".nan"])
def test_refresh_interval_below_one_second_is_refused(value: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(_auth(value), base_dir=Path("."))
    message = str(refused.value)
    assert "auth.jwt.refresh_interval_s must be at least 1 s" in message
    assert message.endswith("- at `$.auth.jwt`")


def test_refresh_interval_of_one_second_is_accepted() -> None:
    config = parse_config(_auth("1"), base_dir=Path("."))
    assert config.auth.jwt is not None and config.auth.jwt.refresh_interval_s == 1.0
