"""A multipart/form-data body (`POST /v1/files`), read whole and bounded, parsed by the standard library."""

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


def parse_form(content_type: str, body: bytes) -> Form:
    """The parts of a multipart body whose `Content-Type` header is `content_type`.

    Raises:
        InvalidInput: not multipart/form-data, or no part could be read.
    """
    if "boundary=" not in content_type:
        raise InvalidInput("send the file as multipart/form-data (with a boundary)")
    head = f"Content-Type: {content_type}\r\nMIME-Version: 1.0\r\n\r\n".encode("latin-1")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    form = Form()
    if not message.is_multipart():
        raise InvalidInput("the multipart body has no parts")
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        payload = part.get_payload(decode=True)
        data = payload if isinstance(payload, bytes) else b""
        filename = part.get_filename()
        if filename is not None:
            form.files[name] = (filename, data)
        else:
            form.fields[name] = data.decode("utf-8", errors="replace").strip()
    return form
