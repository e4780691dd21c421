"""The `remote` backend: another server of the fleet (OpenAI or Open Inference Protocol v2) over HTTP.

Rooms: `backend` (the adapter and its options), `openai_upstream` and `kserve_upstream` (the two
protocols' translation), `client` (the pooled aiohttp client with byte-bounded reads), `errors`.
The registry imports this package and calls `create`.
"""

from __future__ import annotations

from backends.remote.backend import RemoteBackend, RemoteOptions, create
from backends.remote.errors import UpstreamIncomplete, UpstreamMalformed, UpstreamTooLarge

__all__ = ["RemoteBackend", "RemoteOptions", "UpstreamIncomplete", "UpstreamMalformed", "UpstreamTooLarge", "create"]
