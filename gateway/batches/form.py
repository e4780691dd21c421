"""A multipart/form-data body (`POST /v1/files`), parsed as it arrives: the file part goes to a sink
(a temporary file on disk) in pieces of about `FLUSH_BYTES`, so an upload costs about that much
memory whatever its size (a body read whole cost its size, more than once, per concurrent upload).

Parsing is the `multipart` package's push parser (Litestar's own multipart dependency): it takes the
ASGI body chunks one by one and hands back part headers and body pieces, never the whole part.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import multipart

from backends.errors import InvalidInput
from fleetgate.errors import GatewayError

#: file bytes gathered before one write to the sink (off the event loop)
FLUSH_BYTES = 1024 * 1024
#: the text fields of a form together (`purpose` is all OpenAI sends)
MAX_FIELD_BYTES = 16 * 1024
#: parts in one form (OpenAI sends two)
MAX_PARTS = 16
#: the multipart framing around the file (boundaries, part headers, text fields) at most
FRAMING_BYTES = 64 * 1024
#: what is read and dropped of a refused body so that its client reads the answer, not a reset
DRAIN_BYTES = 8 * 1024 * 1024
DRAIN_S = 2.0

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]


class FileSink(Protocol):
    def write(self, data: bytes) -> None:
        """Take the next piece of the file (called off the event loop)."""


@dataclass
class Form:
    """Text fields by name, and the file part that went to the sink (its filename and size)."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    file_bytes: int = 0


_headers = email.parser.HeaderParser(policy=email.policy.HTTP)


def boundary_of(content_type: str) -> str:
    message = _headers.parsestr(f"Content-Type: {content_type}\r\n\r\n")
    boundary = message.get_param("boundary")
    if not isinstance(boundary, str) or not boundary or len(boundary) > 200:
        raise InvalidInput("send the file as multipart/form-data (with a boundary)")
    return boundary


def file_too_large(limit: int) -> GatewayError:
    return GatewayError(
        413, "file_too_large", f"the file is larger than the per-file limit of {limit} bytes (batches.max_file_bytes)"
    )


class _Reader:
    """The state of one form being read: which part is open and what it has received."""

    def __init__(self, file_field: str, sink: FileSink, max_file_bytes: int) -> None:
        self.form = Form()
        self._file_field = file_field
        self._sink = sink
        self._max_file_bytes = max_file_bytes
        self._part: multipart.MultipartSegment | None = None
        self._to_file = False
        self._text: list[bytes] = []
        self._text_bytes = 0
        self.pending: list[bytes] = []  # file bytes not yet handed to the sink
        self.pending_bytes = 0

    def event(self, event: Any) -> None:
        if isinstance(event, multipart.MultipartSegment):
            self._part = event
            self._to_file = event.filename is not None and event.name == self._file_field
            if self._to_file and self.form.filename is not None:
                raise InvalidInput(f"the form has more than one `{self._file_field}` part")
            if self._to_file:
                self.form.filename = event.filename
            return
        if event is None:  # the end of the open part
            if self._part is not None and not self._to_file and self._part.filename is None:
                text = b"".join(self._text).decode("utf-8", errors="replace").strip()
                self.form.fields[self._part.name or ""] = text
            self._part, self._to_file, self._text = None, False, []
            return
        if self._to_file:
            self.form.file_bytes += len(event)
            if self.form.file_bytes > self._max_file_bytes:
                raise file_too_large(self._max_file_bytes)
            self.pending.append(event)
            self.pending_bytes += len(event)
        elif self._part is not None and self._part.filename is None:
            self._text_bytes += len(event)
            if self._text_bytes > MAX_FIELD_BYTES:
                raise InvalidInput(f"the form's text fields exceed {MAX_FIELD_BYTES} bytes")
            self._text.append(event)
        # another file part's bytes are dropped: only `file_field` is stored

    async def flush(self) -> None:
        if self.pending:
            data = b"".join(self.pending)
            self.pending, self.pending_bytes = [], 0
            await asyncio.to_thread(self._sink.write, data)


async def read_form(
    receive: Receive, content_type: str, *, file_field: str, sink: FileSink, max_file_bytes: int
) -> Form:
    """Read a multipart body from the ASGI channel, its `file_field` file part into `sink`.

    Raises:
        InvalidInput: not multipart/form-data, bad framing, too many parts or too much text.
        GatewayError: 413 when the file passes `max_file_bytes` (as soon as it does), 400 when the
            client goes away mid-body.
    """
    parser = multipart.PushMultipartParser(
        boundary_of(content_type), max_header_count=8, max_segment_count=MAX_PARTS
    )
    reader = _Reader(file_field, sink, max_file_bytes)
    try:
        while not parser.closed:
            message = await receive()
            if message["type"] != "http.request":  # http.disconnect: the client went away
                raise GatewayError(400, "client_disconnected", "the client closed the connection mid-body")
            chunk = message.get("body", b"")
            if chunk:
                for event in parser.parse(chunk):
                    reader.event(event)
            if reader.pending_bytes >= FLUSH_BYTES:
                await reader.flush()
            if not message.get("more_body", False):
                parser.close()  # raises when the body ended before its closing boundary
                break
    except multipart.MultipartError as exc:
        raise InvalidInput(f"the multipart body is malformed: {exc}") from None
    await reader.flush()
    return reader.form


class Body:
    """The ASGI channel of a request's body, remembering whether the body has ended."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.ended = False

    async def receive(self) -> MutableMapping[str, Any]:
        message = await self._receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.ended = True
        return message

    async def drain(self) -> None:
        """Read and drop what is left of a refused body, up to `DRAIN_BYTES` for `DRAIN_S`, so that
        a client that sends its whole body before reading (httpx, the openai SDK) reads the refusal
        instead of a connection reset. A larger body is cut (the connection closes)."""
        dropped = 0
        try:
            async with asyncio.timeout(DRAIN_S):
                while not self.ended and dropped <= DRAIN_BYTES:
                    dropped += len((await self.receive()).get("body", b""))
        except TimeoutError:
            pass
