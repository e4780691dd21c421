"""Errors of model sources: each one line a user can act on (what, where, what to set)."""

from __future__ import annotations


class SourceError(Exception):
    """A model address cannot be resolved, fetched or served from the cache (one line)."""


class SourceNotFound(SourceError):
    """The repository, revision, bucket, object or URL does not exist."""


class SourceForbidden(SourceError):
    """No credentials, or credentials the store refuses; the message names the variable to set."""


class ChecksumMismatch(SourceError):
    """What arrived (or what the cache holds) is not what the address promises."""


class DiskFull(SourceError):
    """The cache's volume has no room for the model."""


class NotCached(SourceError):
    """Offline mode is on and the cache does not hold the model (or holds a damaged copy)."""


class Unreachable(SourceError):
    """The store could not be reached (connection refused, DNS, timeout)."""
