"""Import heavy runtimes only when a deployment uses them, with an install hint when missing."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingRuntime(RuntimeError):
    """A deployment needs a runtime that is not installed."""


def require(module: str, *, extra: str) -> ModuleType:
    """Import `module` or raise MissingRuntime telling which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingRuntime(
            f"{module} is not installed ({exc}); install it with: pip install 'fleetgate[{extra}]'"
        ) from None
