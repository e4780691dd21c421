"""The `storage:` section of the config: where fetched models are kept and how they are checked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from fleetgate.spec import SpecBase


def default_cache_dir() -> str:
    """`$XDG_CACHE_HOME/fleetgate/models`, else `~/.cache/fleetgate/models` (the XDG default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "fleetgate" / "models")


class StorageSpec(SpecBase):
    """The model cache shared by the workers and replicas that mount one volume (docs/model_sources.md)."""

    #: folder of the model cache (content-addressed; several processes may share it); null: the XDG
    #: cache folder, `$XDG_CACHE_HOME/fleetgate/models` or `~/.cache/fleetgate/models`
    cache_dir: str | None = None
    #: serve only from the cache, with no network access; a model it does not hold is refused at
    #: start-up with one line (`HF_HUB_OFFLINE=1` has the same effect on `hf://` addresses)
    offline: bool = False
    #: how a cached model is checked before it is served: `sha256` re-reads every file and compares
    #: it with what was verified on download (a damaged file is fetched again); `size` compares sizes only
    verify: Literal["sha256", "size"] = "sha256"
    #: seconds a download may wait for the next bytes from the store; then it fails, keeping what
    #: arrived (a gateway tries again with the load's backoff and resumes; `pull` exits with the error)
    read_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.read_timeout_s > 0:
            raise ValueError("read_timeout_s must be > 0")

    @property
    def root(self) -> Path:
        """The cache folder, resolved."""
        return Path(self.cache_dir or default_cache_dir()).expanduser()
