"""The remote backend's own errors, and an upstream's HTTP error status mapped to a gateway error."""

from __future__ import annotations

import msgspec

from backends.errors import (
    BackendError,
    BackendInternalError,
    BackendTimeout,
    BackendUnavailable,
    InvalidInput,
    ModelNotFound,
)
from backends.runtime.json_errors import JSON_DECODE_ERRORS


class UpstreamTooLarge(BackendInternalError):
    """The upstream's answer passed `max_response_bytes` (a fault of the deployment)."""

    status = 502
    code = "upstream_too_large"


class UpstreamMalformed(BackendInternalError):
    """The upstream's answer is not what its protocol says (a fault of the deployment: bad gateway)."""

    status = 502
    code = "upstream_malformed"


class UpstreamIncomplete(BackendInternalError):
    """The upstream answered without something the call asked for (e.g. logprobs)."""

    status = 502
    code = "upstream_incomplete"


_json_decode = msgspec.json.Decoder()


def upstream_error(status: int, body: bytes) -> BackendError:
    """Map an upstream HTTP error to a gateway error with a short, safe message."""
    try:
        payload = _json_decode.decode(body)
        err = payload.get("error", payload) if isinstance(payload, dict) else payload
        detail = err.get("message", "") if isinstance(err, dict) else str(err)
    except (*JSON_DECODE_ERRORS, AttributeError):
        detail = ""
    detail = " ".join(str(detail).split())[:200]
    message = f"upstream answered {status}" + (f": {detail}" if detail else "")
    if status == 400 or status == 422:
        return InvalidInput(message)
    if status == 404:
        return ModelNotFound(message)
    if status == 504:
        return BackendTimeout(message)
    if status in (401, 403):
        # the gateway's own credentials were refused (a revoked or wrong upstream key): a fault of
        # this deployment, never the caller's, and another route may well serve
        return BackendUnavailable(f"upstream refused the gateway's credentials ({status})")
    if status in (429, 502, 503) or status >= 500:
        return BackendUnavailable(message)
    return BackendInternalError(message)
