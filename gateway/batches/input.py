"""An uploaded batch input file, checked line by line before it is accepted.

Each line is one request, as OpenAI's Batch API takes them:
`{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}`. The body is
decoded with the same decoder its endpoint uses, so a request that its endpoint would refuse for
its shape is refused at upload, with the line named, instead of failing later in the job.
"""

from __future__ import annotations

from typing import Any

import msgspec

from backends.errors import InvalidInput
from backends.runtime.json_errors import JSON_DECODE_ERRORS, describe_decode_error
from gateway.batches.objects import ENDPOINTS
from gateway.wire.openai_schema import chat_decoder, completion_decoder, embeddings_decoder

_BODY_DECODERS = {
    "/v1/chat/completions": chat_decoder,
    "/v1/completions": completion_decoder,
    "/v1/embeddings": embeddings_decoder,
}


class InputLine(msgspec.Struct, kw_only=True):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


_line_decoder = msgspec.json.Decoder(InputLine)


class Request(msgspec.Struct, frozen=True):
    """One request of a batch: its index (0-based line), custom id, endpoint and JSON body."""

    index: int
    custom_id: str
    url: str
    body: bytes


def parse_input(data: bytes, max_lines: int) -> list[Request]:
    """Every request of a JSONL input file (blank lines skipped).

    Raises:
        InvalidInput: the first bad line, named by its 1-based number.
    """
    requests: list[Request] = []
    seen: set[str] = set()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(requests) >= max_lines:
            raise InvalidInput(f"the file has more than {max_lines} requests (batches.max_lines)")
        request = _parse_line(raw, number, len(requests))
        if request.custom_id in seen:
            raise InvalidInput(
                f"line {number}: custom_id {request.custom_id[:64]!r} is not unique in the file"
            )
        seen.add(request.custom_id)
        requests.append(request)
    if not requests:
        raise InvalidInput("the file has no requests: send one JSON object per line")
    return requests


class InputChecker:
    """`parse_input`'s checks on a file that arrives in pieces (an upload), keeping no request: only
    the custom ids seen and the line not finished yet (`feed` each piece, then `close`).

    Raises (from `feed` and `close`): InvalidInput, as `parse_input` does.
    """

    def __init__(self, max_lines: int) -> None:
        self._max_lines = max_lines
        self._seen: set[str] = set()
        self._tail: list[bytes] = []  # the current line's pieces (joined once it ends)
        self._number = 0

    def feed(self, data: bytes) -> None:
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            self._line(b"".join([*self._tail, data[start:end]]) if self._tail else data[start:end])
            self._tail = []
            start = end + 1
        if start < len(data):
            self._tail.append(data[start:])

    def close(self) -> int:
        """Check the last line; the number of requests."""
        if self._tail:
            self._line(b"".join(self._tail))
            self._tail = []
        if not self._seen:
            raise InvalidInput("the file has no requests: send one JSON object per line")
        return len(self._seen)

    def _line(self, raw: bytes) -> None:
        self._number += 1
        if not raw.strip():
            return
        if len(self._seen) >= self._max_lines:
            raise InvalidInput(f"the file has more than {self._max_lines} requests (batches.max_lines)")
        request = _parse_line(raw, self._number, len(self._seen))
        if request.custom_id in self._seen:
            raise InvalidInput(
                f"line {self._number}: custom_id {request.custom_id[:64]!r} is not unique in the file"
            )
        self._seen.add(request.custom_id)


def _parse_line(raw: bytes, number: int, index: int) -> Request:
    try:
        line = _line_decoder.decode(raw)
    except JSON_DECODE_ERRORS as exc:
        raise InvalidInput(f"line {number}: {describe_decode_error(exc)}") from None
    if not line.custom_id or len(line.custom_id) > 512:
        raise InvalidInput(f"line {number}: custom_id must be a non-empty string of at most 512 characters")
    if line.method != "POST":
        raise InvalidInput(f"line {number}: method must be POST, got {line.method[:16]!r}")
    if line.url not in ENDPOINTS:
        raise InvalidInput(f"line {number}: url must be one of {', '.join(ENDPOINTS)}, got {line.url[:64]!r}")
    body = bytes(line.body)
    try:
        decoded: Any = _BODY_DECODERS[line.url].decode(body)
    except JSON_DECODE_ERRORS as exc:
        raise InvalidInput(f"line {number}: body: {describe_decode_error(exc)}") from None
    if getattr(decoded, "stream", False):
        raise InvalidInput(f"line {number}: body: `stream` is not supported in a batch")
    return Request(index=index, custom_id=line.custom_id, url=line.url, body=body)
