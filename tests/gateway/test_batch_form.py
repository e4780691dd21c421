"""The streaming multipart reader of `POST /v1/files`: what httpx (the openai SDK's client) sends,
parsed exactly whatever the chunking of the body, the file handed to its sink in pieces; malformed
framing refused with a clear 400, a file over the per-file limit with 413."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from backends.errors import InvalidInput
from fleetgate.errors import GatewayError
from gateway.batches.form import Form, read_form


class ListSink:
    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.pieces.append(data)


def _encoded(data: bytes, **fields: str) -> tuple[str, bytes]:
    request = httpx.Request("POST", "http://gw/v1/files", files={"file": ("in.jsonl", data)}, data=fields)
    return request.headers["content-type"], request.read()


def _read(content_type: str, body: bytes, chunk: int, max_file_bytes: int = 1 << 30) -> tuple[Form, bytes]:
    messages = [
        {"type": "http.request", "body": body[i : i + chunk], "more_body": i + chunk < len(body)}
        for i in range(0, len(body), chunk)
    ] or [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    sink = ListSink()
    form = asyncio.run(
        read_form(receive, content_type, file_field="file", sink=sink, max_file_bytes=max_file_bytes)
    )
    return form, b"".join(sink.pieces)


@pytest.mark.parametrize("chunk", [7, 4096, 1 << 30])
def test_a_file_and_fields_as_httpx_sends_them(chunk: int) -> None:
    data = b'{"custom_id": "a"}\r\n--looks-like-a-boundary\r\n\r\n' * 1000  # CRLF and dashes inside
    content_type, body = _encoded(data, purpose="batch")
    form, stored = _read(content_type, body, chunk)
    assert form.fields == {"purpose": "batch"} and form.filename == "in.jsonl"
    assert stored == data and form.file_bytes == len(data)


def test_a_large_file_reaches_the_sink_in_pieces() -> None:
    data = b"x" * (3 * 1024 * 1024 + 5)
    content_type, body = _encoded(data, purpose="batch")
    messages_chunk = 64 * 1024
    sink_form, stored = _read(content_type, body, messages_chunk)
    assert stored == data and sink_form.file_bytes == len(data)


def test_a_file_over_the_limit_is_refused_with_413_naming_it() -> None:
    content_type, body = _encoded(b"y" * 5000, purpose="batch")
    with pytest.raises(GatewayError) as info:
        _read(content_type, body, 1024, max_file_bytes=4096)
    assert info.value.status == 413 and "4096" in info.value.message and "max_file_bytes" in info.value.message


@pytest.mark.parametrize(
    "content_type, cut, words",
    [
        ("multipart/form-data", 0, "boundary"),
        (None, 20, "malformed"),
        ("multipart/form-data; boundary=other", 0, "malformed"),
    ],
)
def test_malformed_framing_is_refused(content_type: str | None, cut: int, words: str) -> None:
    real_type, body = _encoded(b"x\n", purpose="batch")
    with pytest.raises(InvalidInput) as info:
        _read(content_type or real_type, body[: len(body) - cut] if cut else body, 1 << 20)
    assert words in info.value.message
