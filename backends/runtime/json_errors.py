"""The exceptions a msgspec JSON decode can raise on bytes someone else wrote.

Besides `DecodeError` and `ValidationError`, msgspec raises `UnicodeDecodeError` for invalid UTF-8
inside a string and `RecursionError` for nesting beyond its depth limit (about a thousand levels).
Every place that decodes a client's body or an upstream's answer catches all four, so none of them
can become a 500 with a traceback.
"""

from __future__ import annotations

import msgspec

#: catch these around any decode of untrusted JSON
JSON_DECODE_ERRORS: tuple[type[Exception], ...] = (
    msgspec.DecodeError,
    UnicodeDecodeError,
    RecursionError,
)


def describe_decode_error(exc: Exception) -> str:
    """A short, safe description of why untrusted JSON was refused."""
    if isinstance(exc, msgspec.ValidationError):
        return f"invalid request: {exc}"
    if isinstance(exc, UnicodeDecodeError):
        return "malformed JSON: invalid UTF-8"
    if isinstance(exc, RecursionError):
        return "malformed JSON: nested too deeply"
    return f"malformed JSON: {exc}"
