"""A job's results: each finished line appended to a part file, assembled into output files at the end.

While a job runs, every finished line is appended to this process's part file as
`{"i": index, "a": attempt, "out": <output line>}`, before the line's done mark is committed. A
process that dies may leave a line in a part file without its mark (that attempt is not on the
bill, and the line runs again), or a torn last line (skipped when read). At the end, the output
and error files take, for each line, the entry of the attempt its mark names: one line per request.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec

from gateway.batches.book import LineDone
from gateway.batches.dispatch import LineAnswer
from gateway.batches.input import Request
from gateway.batches.objects import new_id

_encoder = msgspec.json.Encoder()


class PartEntry(msgspec.Struct):
    i: int
    a: str
    out: msgspec.Raw


_entry_decoder = msgspec.json.Decoder(PartEntry)


def output_line(request: Request, answer: LineAnswer) -> dict[str, Any]:
    """A finished request as OpenAI's output (2xx) and error files write it."""
    return {
        "id": "batch_req_" + answer.request_id,
        "custom_id": request.custom_id,
        "response": {"status_code": answer.status, "request_id": answer.request_id, "body": answer.body},
        "error": None,
    }


def unrun_line(request: Request, code: str, message: str) -> bytes:
    """A request the job did not run (the completion window passed first), for the error file."""
    line = {
        "id": new_id("batch_req_"),
        "custom_id": request.custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return _encoder.encode(line)


class PartFile:
    """This process's part file of one job (opened on the first line, appended and flushed)."""

    def __init__(self, directory: Path, name: str) -> None:
        self._path = directory / f"part-{name}.jsonl"
        self._file: Any = None

    def append(self, index: int, attempt: str, out: dict[str, Any]) -> None:
        # flushed to the kernel before the mark is committed: a process crash loses nothing
        # written here (a power loss can; see docs/batches.md)
        if self._file is None:
            self._path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # owner only
            self._file = os.fdopen(fd, "ab")  # held open for the job's life
        self._file.write(_encoder.encode({"i": index, "a": attempt, "out": out}) + b"\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_parts(directory: Path) -> dict[tuple[int, str], bytes]:
    """Every entry of every part file of a job: (index, attempt) -> its output line."""
    entries: dict[tuple[int, str], bytes] = {}
    if not directory.is_dir():
        return entries
    for path in sorted(directory.glob("part-*.jsonl")):
        for raw in path.read_bytes().split(b"\n"):
            try:
                entry = _entry_decoder.decode(raw)
            except msgspec.DecodeError:  # blank, or torn by a crash mid-write
                continue
            entries[(entry.i, entry.a)] = bytes(entry.out)
    return entries


def assemble(
    requests: list[Request], done: dict[int, LineDone], entries: dict[tuple[int, str], bytes], expired: bool
) -> tuple[list[bytes], list[bytes]]:
    """(output lines, error lines) in input order: each done line once, from the attempt its mark
    names; with `expired`, the lines that never ran go to the error file as `batch_expired`."""
    output: list[bytes] = []
    errors: list[bytes] = []
    for request in requests:
        mark = done.get(request.index)
        if mark is None:
            if expired:
                message = "This request could not be executed before the completion window expired."
                errors.append(unrun_line(request, "batch_expired", message))
            continue
        line = entries.get((request.index, mark.attempt))
        if line is None:  # only after a loss of the disk's cache (see PartFile.append)
            errors.append(unrun_line(request, "output_lost", "The result of this request was lost."))
            continue
        (output if mark.ok else errors).append(line)
    return output, errors


def remove_parts(directory: Path) -> None:
    for path in directory.glob("part-*.jsonl"):
        path.unlink(missing_ok=True)
    if directory.is_dir():
        os.rmdir(directory)
