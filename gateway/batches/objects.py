"""The file and batch objects, as OpenAI's API shapes them, and how they are stored.

A stored record is the public object plus a few private fields (who created a batch, with which
key restrictions), which `public()` leaves out of every answer.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

import msgspec

#: the endpoints a batch line may call
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
#: statuses after which a batch never changes again
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
#: OpenAI accepts "24h"; shorter windows (`<n>h`, `<n>m`, `<n>s`) are accepted as well
MAX_WINDOW_S = 24 * 3600
_WINDOW = re.compile(r"^([1-9][0-9]{0,5})([hms])$")

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]


def new_id(prefix: str) -> str:
    """A fresh object id, e.g. `batch_6f1c...` (96 random bits: not guessable across tenants)."""
    return prefix + os.urandom(12).hex()


def window_seconds(window: str) -> int | None:
    """Seconds of a completion window ("24h"), or None when it is not one this gateway accepts."""
    match = _WINDOW.match(window)
    if match is None:
        return None
    seconds = int(match.group(1)) * {"h": 3600, "m": 60, "s": 1}[match.group(2)]
    return seconds if seconds <= MAX_WINDOW_S else None


class FileObject(msgspec.Struct, kw_only=True):
    """An uploaded file, or a job's output or error file (OpenAI's `file` object)."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class RequestCounts(msgspec.Struct):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(msgspec.Struct, kw_only=True):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(msgspec.Struct):
    data: list[BatchError]
    object: str = "list"


class BatchRecord(msgspec.Struct, kw_only=True):
    """A batch job: OpenAI's `batch` object, plus who created it (`owner_*`, never shown)."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    created_at: int
    expires_at: int
    request_counts: RequestCounts = msgspec.field(default_factory=RequestCounts)
    object: str = "batch"
    errors: BatchErrors | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    metadata: dict[str, str] | None = None
    #: the key that created the job, and the models it may see: every line runs with them
    owner_key: str = ""
    owner_models: list[str] = msgspec.field(default_factory=lambda: ["*"])
    #: creation time to the microsecond: the listing order (created_at is whole seconds)
    created: float = 0.0

    def public(self, cancel_requested_at: int | None = None) -> dict[str, Any]:
        """The object as the API answers it. A job whose cancel was asked and that has not ended
        yet shows `cancelling` (the runner writes the record; the cancel is a separate mark)."""
        out = msgspec.to_builtins(self)
        del out["owner_key"], out["owner_models"], out["created"]
        if cancel_requested_at is not None and self.status not in TERMINAL:
            out["status"] = "cancelling"
            out["cancelling_at"] = self.cancelling_at or cancel_requested_at
        return out


_record_decoder = msgspec.json.Decoder(BatchRecord)
_file_decoder = msgspec.json.Decoder(FileObject)


def decode_batch(body: str | bytes) -> BatchRecord:
    return _record_decoder.decode(body)


def decode_file(body: str | bytes) -> FileObject:
    return _file_decoder.decode(body)


def encode(obj: msgspec.Struct) -> str:
    return msgspec.json.encode(obj).decode()
