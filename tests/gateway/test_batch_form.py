"""The multipart parser of `POST /v1/files`: what httpx (the openai SDK's client) sends, parsed
exactly, with the file's bytes copied once; malformed framing refused with a clear 400."""

from __future__ import annotations

import httpx
import pytest

from backends.errors import InvalidInput
from gateway.batches.form import parse_form


def _encoded(data: bytes, **fields: str) -> tuple[str, bytes]:
    request = httpx.Request("POST", "http://gw/v1/files", files={"file": ("in.jsonl", data)}, data=fields)
    return request.headers["content-type"], request.read()


def test_a_file_and_fields_as_httpx_sends_them() -> None:
    data = b'{"custom_id": "a"}\r\n--looks-like-a-boundary\r\n\r\n' * 1000  # CRLF and dashes inside
    content_type, body = _encoded(data, purpose="batch")
    form = parse_form(content_type, body)
    assert form.fields == {"purpose": "batch"} and form.files["file"] == ("in.jsonl", data)


@pytest.mark.parametrize(
    "content_type, cut, words",
    [
        ("multipart/form-data", 0, "boundary"),
        (None, 20, "cut short"),
        ("multipart/form-data; boundary=other", 0, "no parts"),
    ],
)
def test_malformed_framing_is_refused(content_type: str | None, cut: int, words: str) -> None:
    real_type, body = _encoded(b"x\n", purpose="batch")
    with pytest.raises(InvalidInput) as info:
        parse_form(content_type or real_type, body[: len(body) - cut] if cut else body)
    assert words in info.value.message
