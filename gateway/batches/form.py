"""A multipart/form-data body (`POST /v1/files`), read whole and bounded, split without copies.

The body is searched for its boundaries in place, so a file part costs one copy of its bytes (the
standard library's `email` parser took six to eight times the body's size in memory for a large
upload). Each part's small header block is read with the standard library's header parser (quoting
and RFC 2231 parameters as it handles them).
"""

from __future__ import annotations

import email.parser
import email.policy
from dataclasses import dataclass, field

from backends.errors import InvalidInput


@dataclass
class Form:
    """Text fields by name, and files by field name as (filename, bytes)."""

    fields: dict[str, str] = field(default_factory=dict)
    files: dict[str, tuple[str, bytes]] = field(default_factory=dict)


_headers = email.parser.HeaderParser(policy=email.policy.HTTP)


def _boundary(content_type: str) -> bytes:
    message = _headers.parsestr(f"Content-Type: {content_type}\r\n\r\n")
    boundary = message.get_param("boundary")
    if not isinstance(boundary, str) or not boundary or len(boundary) > 200:
        raise InvalidInput("send the file as multipart/form-data (with a boundary)")
    return boundary.encode("latin-1")


def parse_form(content_type: str, body: bytes) -> Form:
    """The parts of a multipart body whose `Content-Type` header is `content_type`.

    Raises:
        InvalidInput: not multipart/form-data, or the body is not framed by its boundary.
    """
    delimiter = b"--" + _boundary(content_type)
    at = body.find(delimiter)
    if at < 0:
        raise InvalidInput("the multipart body has no parts")
    form = Form()
    at += len(delimiter)
    while not body.startswith(b"--", at):  # "--" after a delimiter closes the body
        line_end = body.find(b"\r\n", at)
        headers_end = body.find(b"\r\n\r\n", line_end) if line_end >= 0 else -1
        next_part = body.find(b"\r\n" + delimiter, headers_end + 4) if headers_end >= 0 else -1
        if next_part < 0:
            raise InvalidInput("the multipart body is cut short (a part without its closing boundary)")
        part = _headers.parsestr(body[line_end + 2 : headers_end + 4].decode("utf-8", "replace"))
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            content = body[headers_end + 4 : next_part]
            filename = part.get_filename()
            if filename is not None:
                form.files[name] = (filename, content)
            else:
                form.fields[name] = content.decode("utf-8", errors="replace").strip()
        at = next_part + 2 + len(delimiter)
    return form
