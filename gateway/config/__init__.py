"""The gateway's configuration: YAML decoded into msgspec Structs, checked once at start-up.

Every problem is reported as one `ConfigError` line naming the path in the file, e.g.
`Expected `int`, got `str` - at `$.server.port``. Relative paths in the file (model files, the
SQLite state file) are resolved against the directory of the config file, so a config works
whatever directory fleetgate is started from.

The package, one concern a module: `spec` (the root `Config` and its smaller sections), `server`
(the `server:` section), `loading` (`parse_config`, `load_config`), `checks` (per-field checks and
YAML errors), `references` (cross-section checks). The names below are the package's public face,
imported by the rest of the code as `from gateway.config import ...`.
"""

from __future__ import annotations

from gateway.config.checks import ConfigError
from gateway.config.loading import load_config, parse_config
from gateway.config.server import ServerConfig
from gateway.config.spec import (
    AdminConfig,
    Config,
    DeploymentConfig,
    StateConfig,
    TracingConfig,
    with_listen_overrides,
)

__all__ = [
    "AdminConfig",
    "Config",
    "ConfigError",
    "DeploymentConfig",
    "ServerConfig",
    "StateConfig",
    "TracingConfig",
    "load_config",
    "parse_config",
    "with_listen_overrides",
]
