"""Model sources: addresses (`hf://`, `s3://`, `https://`), the verified cache they are fetched
into, and the resolver the config, the loaders and `fleetgate pull` call (docs/model_sources.md)."""

from backends.sources.address import Address, is_address, looks_like_repo_id, parse_address
from backends.sources.errors import SourceError
from backends.sources.resolver import ModelSources
from backends.sources.spec import StorageSpec

__all__ = [
    "Address",
    "ModelSources",
    "SourceError",
    "StorageSpec",
    "is_address",
    "looks_like_repo_id",
    "parse_address",
]
