"""Batch files on a budget, through a running gateway with the real `openai` SDK and httpx: an upload
over the per-file limit is refused with 413, a tenant over its storage quota with 429 (413 when the
file alone can never fit) while other tenants upload as before, deleting a file frees its bytes, and
an upload is written to disk as it arrives: the gateway's memory grows far less than the file."""

from __future__ import annotations

import io
import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.config import parse_config
from gateway.http.app import create_app
from tests.conftest import create_key
from tests.gateway.test_batches import chat_line
from tests.servers import serve_app

MIB = 1024 * 1024


def storage_yaml(root: Path, max_file_bytes: int, max_tenant_bytes: int) -> str:
    return f"""
state: {{url: "sqlite:///{root / 'state.db'}"}}
batches:
  files_dir: "{root / 'files'}"
  max_file_bytes: {max_file_bytes}
  max_tenant_bytes: {max_tenant_bytes}
  max_lines: 200000
tenants:
  acme: {{}}
  other: {{}}
deployments:
  echo-remote: {{backend: remote, url: "http://127.0.0.1:9", protocol: openai, model_name: echo}}
models:
  echo: {{routes: [{{deployment: echo-remote}}]}}
"""


def input_lines(size: int, tag: str, line_bytes: int = 1024) -> Iterator[bytes]:
    """A valid batch input file of about `size` bytes, line by line (never held whole)."""
    template = json.dumps(chat_line(f"{tag}-{{}}", "{}")).encode() + b"\n"
    for i in range((size + line_bytes - 1) // line_bytes):
        head = template.replace(b"{}", str(i).encode(), 1)
        yield head.replace(b"{}", b"w" * max(1, line_bytes - len(head)), 1)


def sized(size: int, tag: str) -> bytes:
    return b"".join(input_lines(size, tag))


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, openai.OpenAI]]]:
    root = tmp_path_factory.mktemp("storage")
    config = parse_config(storage_yaml(root, 4 * MIB, 3 * MIB), base_dir=root)
    with serve_app(create_app(config)) as url:
        clients = {
            t: openai.OpenAI(base_url=f"{url}/v1", api_key=create_key(url, t), max_retries=0)
            for t in ("acme", "other")
        }
        yield url, clients


def _upload(client: openai.OpenAI, data: bytes) -> str:
    return client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id


def test_a_file_over_the_per_file_limit_is_refused_with_413(small: tuple[str, dict[str, openai.OpenAI]]) -> None:
    _, clients = small
    with pytest.raises(openai.APIStatusError) as info:
        _upload(clients["acme"], sized(5 * MIB, "big"))  # refused on its Content-Length
    assert info.value.status_code == 413
    assert "per-file limit of 4194304 bytes" in info.value.message
    assert not clients["acme"].files.list().data  # nothing stored, nothing counted


def test_a_chunked_upload_is_cut_at_the_per_file_limit(small: tuple[str, dict[str, openai.OpenAI]]) -> None:
    url, clients = small
    boundary = "b0undary"
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
    ).encode()

    def body() -> Iterator[bytes]:  # no Content-Length: the limit is found while reading
        yield head
        yield from input_lines(5 * MIB, "chunked", line_bytes=64 * 1024)
        yield f"\r\n--{boundary}--\r\n".encode()

    response = httpx.post(
        f"{url}/v1/files",
        content=body(),
        headers={
            "authorization": f"Bearer {clients['acme'].api_key}",
            "content-type": f"multipart/form-data; boundary={boundary}",
        },
        timeout=30,
    )
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "file_too_large"


def test_a_tenant_over_its_quota_is_refused_and_others_are_not(
    small: tuple[str, dict[str, openai.OpenAI]],
) -> None:
    _, clients = small
    acme, other = clients["acme"], clients["other"]
    kept = [_upload(acme, sized(MIB, f"q{i}")) for i in range(2)]  # 2 MiB of 3 stored
    with pytest.raises(openai.APIStatusError) as info:
        _upload(acme, sized(MIB + MIB // 2, "q2"))  # 3.5 MiB: over the quota
    assert info.value.status_code == 429
    message = info.value.message
    in_use = sum(len(sized(MIB, f"q{i}")) for i in range(2))
    assert "storage quota of 3145728 bytes" in message and f"{in_use} bytes are in use" in message
    with pytest.raises(openai.APIStatusError) as never:
        _upload(acme, sized(3 * MIB + MIB // 2, "q3"))  # alone larger than the quota
    assert never.value.status_code == 413 and "can never fit" in never.value.message
    # another tenant's uploads are unaffected
    theirs = _upload(other, sized(MIB + MIB // 2, "o1"))
    assert other.files.retrieve(theirs).bytes == len(sized(MIB + MIB // 2, "o1"))
    # deleting a file frees its bytes: the refused upload now fits
    acme.files.delete(kept[0])
    again = _upload(acme, sized(MIB + MIB // 2, "q2"))
    assert acme.files.content(again).content == sized(MIB + MIB // 2, "q2")
    for file_id in (kept[1], again):
        acme.files.delete(file_id)
    other.files.delete(theirs)


def test_a_bad_line_is_refused_and_its_bytes_are_not_counted(
    small: tuple[str, dict[str, openai.OpenAI]], tmp_path: Path
) -> None:
    _, clients = small
    data = sized(MIB, "bad") + b'{"custom_id": "x", "method": "GET"}\n'
    with pytest.raises(openai.BadRequestError) as info:
        _upload(clients["acme"], data)
    assert "line 1025" in info.value.message
    stored = [_upload(clients["acme"], sized(MIB, f"after{i}")) for i in range(3)]  # all 3 MiB free
    for file_id in stored:
        clients["acme"].files.delete(file_id)


def test_a_large_upload_is_written_to_disk_as_it_arrives(tmp_path: Path) -> None:
    size = 32 * MIB
    config = parse_config(storage_yaml(tmp_path, 64 * MIB, 256 * MIB), base_dir=tmp_path)
    with serve_app(create_app(config)) as url:
        key = create_key(url, "acme")
        boundary = "b0undary"
        head = (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n\r\n'
        ).encode()
        tail = f"\r\n--{boundary}--\r\n".encode()
        length = len(head) + sum(len(x) for x in input_lines(size, "rss")) + len(tail)

        def body() -> Iterator[bytes]:  # the client never holds the file either
            yield head
            yield from input_lines(size, "rss")
            yield tail

        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            response = httpx.post(
                f"{url}/v1/files",
                content=body(),
                headers={
                    "authorization": f"Bearer {key}",
                    "content-type": f"multipart/form-data; boundary={boundary}",
                    "content-length": str(length),
                },
                timeout=120,
            )
            peak = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        assert response.status_code == 200, response.text
        assert response.json()["bytes"] == length - len(head) - len(tail)
        # read whole, the body alone took its size (and its parse more): streamed, a few MiB
        assert peak < size // 4, f"upload of {size} bytes raised traced memory by {peak} bytes"
