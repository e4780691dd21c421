"""The config's state store, opened for a command that reads or writes it (keys, usage).

A memory:// state lives inside the server process, so a command refuses it rather than write
where no server would read.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.config import Config, ConfigError


async def with_store(config: Config, work: Callable[[Any, Any], Awaitable[int]]) -> int:
    from policies.admission import Admission
    from policies.keys import KeyService
    from policies.stores import open_store

    if config.state.url.startswith("memory://"):
        raise ConfigError(
            "the state is memory:// (it lives inside the server process), so nothing written here "
            "would reach a server: create keys through the running server's admin API "
            "(POST /admin/keys with the admin key), or use `state: {url: sqlite:///...}`"
        )
    store = await open_store(config.state.url)
    try:
        keys = KeyService(store, time.time, tenants=list(config.tenants))
        admission = Admission(store, config.tenants, time.time)
        return await work(keys, admission)
    finally:
        await store.close()


def check_tenant(config: Config, tenant: str | None) -> None:
    """A `--tenant` filter naming no configured tenant is a typo, not an empty answer."""
    if tenant is not None and tenant not in config.tenants:
        configured = ", ".join(sorted(config.tenants)) or "none"
        raise ConfigError(f"unknown tenant {tenant!r} (configured: {configured})")
